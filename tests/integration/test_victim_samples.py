"""A pressure pass samples the tier it relieves, not the whole node (index sets tobj:<node>:<tier>,
kept by every script that adds, moves or drops a replica), and a pass that falls short of a
waiting writer's room hands the request on to the next pass of the same wake.

Real Redis (the session's embedded server), the real RedisIndex and its scripts, real in-process
agents with their pressure loop idle (each test drives the passes as PressureManager.run would)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import fill, node_row, pending_put
from index_audit import audit_index, settled_audit

from mooncake_store import Client
from mooncake_store.agent import pressure as pressure_module
from mooncake_store.agent.node import Agent
from mooncake_store.agent.pressure import MAX_PASSES
from mooncake_store.index.client import RedisIndex
from mooncake_store.types import Replica, ReplicaState, TierKind, TierUsage

TTL_MS = 600_000
TIERS = (
    TierUsage(tier=TierKind.HOST, capacity_bytes=1 << 30, used_bytes=0),
    TierUsage(tier=TierKind.DISK, capacity_bytes=1 << 30, used_bytes=0),
)


@pytest.fixture
def index(redis_url: str) -> Iterator[RedisIndex]:
    idx = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}", timeout_s=60.0)
    try:
        for node in ("A", "B"):
            idx.register_node(node_row(node, tiers=TIERS), incarnation=f"inc-{node}", ttl_ms=TTL_MS)
        yield idx
    finally:
        idx.close()


def replica(node: str, tier: TierKind, alloc: int) -> Replica:
    return Replica(node_id=node, tier=tier, offset=0, size_bytes=16, alloc_id=alloc, state=ReplicaState.COMPLETE)


def commit(index: RedisIndex, placed: dict[str, tuple[str, TierKind, int]]) -> None:
    """Objects of 16 B, each with one replica (node, tier, alloc id), committed."""
    puts = [pending_put(key, where) for key, where in placed.items()]
    index.put_start(puts, ttl_ms=TTL_MS)
    assert set(index.put_commit([p.put_id for p in puts])) == {"OK"}


def tier_set(index: RedisIndex, node: str, tier: TierKind) -> set[str]:
    return set(index.redis.smembers(f"{index.prefix}tobj:{node}:{tier}"))


def test_a_host_sample_is_drawn_from_the_host_tier_alone(index: RedisIndex) -> None:
    """victims.lua drew its sample from nobj:<node>, every tier of the node, and kept the members
    on the tier asked for: a node with 96 objects in host memory and 2,904 chunk files listed ~8
    host candidates in a sample of 256, so a pass over its host tier found almost nothing to move
    and a writer waiting there got its room one pass (one retry) at a time."""
    host = {f"h{i:03d}": ("A", TierKind.HOST, 1 + i) for i in range(96)}
    disk = {f"d{i:04d}": ("A", TierKind.DISK, 1000 + i) for i in range(2904)}
    commit(index, host)
    commit(index, disk)
    sampled = index.victim_candidates("A", "host", sample=256)
    assert sorted(c.key for c in sampled) == sorted(host), f"{len(sampled)} of the 96 host objects sampled"
    on_disk = index.victim_candidates("A", "disk", sample=256)
    assert len(on_disk) == 256 and {c.key for c in on_disk} <= set(disk)
    assert index.victim_candidates("B", "host", sample=256) == []
    assert not audit_index(index)


def test_the_tier_sets_follow_every_script_that_moves_or_drops_a_replica(index: RedisIndex) -> None:
    """Commit, demotion on the node, a spill to a peer, two swaps of one key in one batch, eviction,
    a damaged replica dropped, a remove, a replacement and a reap each leave every key listed in
    exactly the tier sets its replicas are on (the audit checks both ways)."""
    commit(index, {f"k{i}": ("A", TierKind.HOST, 1 + i) for i in range(8)})
    assert tier_set(index, "A", TierKind.HOST) == {f"k{i}" for i in range(8)}
    # Demotion: host to disk on the same node.
    assert index.move_replica("k0", old_node="A", old_alloc_id=1, new=replica("A", TierKind.DISK, 100)) == "OK"
    # A spill to a peer's host tier, and one batch that moves k2 to disk and back to host.
    statuses = index.move_replicas(
        [
            ("k1", 2, replica("B", TierKind.HOST, 200), ""),
            ("k2", 3, replica("A", TierKind.DISK, 300), ""),
            ("k2", 300, replica("A", TierKind.HOST, 301), ""),
        ],
        old_node="A",
    )
    assert statuses == ["OK", "OK", "OK"]
    assert tier_set(index, "A", TierKind.DISK) == {"k0"}
    assert tier_set(index, "B", TierKind.HOST) == {"k1"}
    assert "k2" in tier_set(index, "A", TierKind.HOST)
    assert not audit_index(index)
    # Eviction, a damaged replica, a remove and a replacement.
    assert index.evict_many([("k3", 4)], node_id="A") == ["OK"]
    assert index.drop_corrupt("k0", 100, node_id="A")
    index.remove(["k4"])
    commit(index, {"k5": ("B", TierKind.DISK, 500)})
    assert tier_set(index, "A", TierKind.HOST) == {"k2", "k6", "k7"}
    assert tier_set(index, "A", TierKind.DISK) == set()
    assert tier_set(index, "B", TierKind.DISK) == {"k5"}
    assert not audit_index(index)
    # A reap of a dead node drops its replicas and its sets.
    index.redis.zadd(index.prefix + "hb", {"A": 1})
    assert index.reap_dead_nodes(grace_ms=0) == ["A"]
    assert tier_set(index, "A", TierKind.HOST) == set()
    assert not [k for k in index.redis.scan_iter(match=index.prefix + "tobj:A:*")]
    assert not audit_index(index)


def test_a_pass_short_of_a_waiting_writers_room_hands_it_to_the_next_pass(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """want_room's request was taken (and cleared) by the first pass of a wake; a pass whose sample
    held fewer movable objects than the writer lacked made part of its room, and the passes after
    it drained only to the watermark (nothing, under it), so the writer waited for its next refused
    RESERVE, pass by pass. Samples of 2 objects stand for a sample short of candidates."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    agent = direct_agent(namespace)
    client = client_of(namespace)
    monkeypatch.setattr(pressure_module, "SAMPLE", 2)
    values = fill(client, agent, n=10)  # 2.5 MiB of 4: under the high watermark
    wanted = 3 << 20
    largest_free = agent.table.usage()[2]
    assert largest_free < wanted
    agent.pressure.want_room([wanted])
    passes = 0
    while passes < MAX_PASSES:  # what PressureManager.run does after a wake
        passes += 1
        if agent.pressure.relieve_host() == 0:
            break
    room = agent.table.usage()[2]
    assert room >= wanted, (
        f"largest free block {room} B after {passes} passes of 2-object samples for a {wanted} B "
        f"request ({largest_free} B free before): the passes after the first forgot the waiting writer"
    )
    assert agent.pressure.requests.wanted[TierKind.HOST] == ()
    left = [k for k, v in values.items() if client.exists(k)]
    assert all(np.array_equal(client.get(k), values[k]) for k in left)
    assert not settled_audit(agent.index)
