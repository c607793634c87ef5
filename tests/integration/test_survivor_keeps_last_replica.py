"""A node's death must not cost a replicas=2 object its data through the survivor's eviction.

Between a node's death and the repair of what it held (its reap comes about two heartbeat TTLs
later, and the copy needs a peer with room), a replicated object's copy on the survivor is its last
live one. A survivor under pressure with nowhere to move its victims evicted coldest first, and a
cold replicated object went while warmer objects stored with replicas=1 (one copy by choice)
stayed: the object the user was promised survives one node's death was lost to its death.

The index's part on the session's real Redis (victims.lua called as an agent calls it), and the
whole of it with real agent processes, the dead node killed with SIGKILL by its pid."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import node_row, pending_put, wait_until

from mooncake_store import Client, LocalCluster
from mooncake_store.index.client import RedisIndex
from mooncake_store.types import TierKind, TierUsage

MiB = 1 << 20
TTL_MS = 600_000


@pytest.fixture
def index(redis_url: str) -> Iterator[RedisIndex]:
    idx = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}", timeout_s=60.0)
    tiers = (TierUsage(tier=TierKind.HOST, capacity_bytes=1 << 30, used_bytes=0),)
    try:
        for node in ("A", "B", "C"):
            idx.register_node(node_row(node, tiers=tiers), incarnation=f"inc-{node}", ttl_ms=TTL_MS)
        yield idx
    finally:
        idx.close()


def commit(index: RedisIndex, key: str, *placed: tuple[str, int]) -> None:
    put = pending_put(key, *((node, TierKind.HOST, alloc) for node, alloc in placed))
    index.put_start([put], ttl_ms=TTL_MS)
    assert index.put_commit([put.put_id]) == ["OK"]


def survivors(index: RedisIndex, node: str) -> dict[str, bool]:
    return {c.key: c.survivor for c in index.victim_candidates(node, "host")}


def test_the_sample_marks_the_last_live_copy_of_an_object_a_death_left_short(index: RedisIndex) -> None:
    commit(index, "two", ("A", 1), ("B", 2))  # replicas=2, its other copy on the node that dies
    commit(index, "spread", ("A", 3), ("C", 4))  # its other copy on a live node: evicting loses nothing
    commit(index, "one", ("A", 5))  # one copy by choice
    commit(index, "dropped", ("A", 6), ("C", 7))
    # A full node's pass drops a copy: listed for repair at A, its last copy is kept as one.
    assert index.evict("dropped", node_id="C", alloc_id=7) == "OK"
    assert survivors(index, "A") == {"two": False, "spread": False, "one": False, "dropped": True}
    index.redis.zadd(index.prefix + "hb", {"B": 1})  # B past its deadline: dead, not yet reaped
    assert survivors(index, "A") == {"two": True, "spread": False, "one": False, "dropped": True}
    assert index.reap_dead_nodes(grace_ms=0) == ["B"]  # purged: "two" is listed for repair at A
    assert survivors(index, "A") == {"two": True, "spread": False, "one": False, "dropped": True}


def nodes_of(client: Client, key: str) -> set[str]:
    meta = client.object_meta(key)
    return {r.node_id for r in meta.replicas} if meta is not None else set()


@pytest.mark.parametrize("reaped", [False, True], ids=["dead", "reaped"])
def test_a_survivor_evicts_single_copies_before_the_last_copy_of_a_replicated_object(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], reaped: bool
) -> None:
    """``reaped``: the writes come once the dead node's purge has listed the objects for repair
    (which has nowhere to copy them), else while it is only past its deadline."""
    # 16 MiB host tiers, no disk: past 14.4 MiB (0.9) a pass drains to 12 MiB (0.75).
    cluster = make_cluster(3, host_bytes=16 * MiB, heartbeat_ttl_s=1.5)
    a, b, c = "agent-0", "agent-1", "agent-2"
    client = make_client(cluster, timeout_s=20.0)

    def value(i: int) -> np.ndarray:
        return np.random.default_rng(i).integers(0, 255, MiB, dtype=np.uint8)

    # The third node just under its high watermark: no spill from A and no repair copy fits there.
    for i in range(14):
        client.put(f"full/{i:02d}", value(100 + i), preferred_node=c)
    # The coldest on A: replicated, their second copies on B (C has no room for them).
    replicated = {f"two/{i:02d}": value(i) for i in range(6)}
    for key, data in replicated.items():
        client.put(key, data, replicas=2, preferred_node=a)
    assert all(nodes_of(client, k) == {a, b} for k in replicated), {k: nodes_of(client, k) for k in replicated}
    # Warmer on A, one copy by choice: A at 12 MiB of 16, under its high watermark.
    single = {f"one/{i:02d}": value(200 + i) for i in range(6)}
    for key, data in single.items():
        client.put(key, data, preferred_node=a)
    cluster.agent(b).kill()
    if reaped:
        assert wait_until(lambda: all(n.node_id != b for n in client.stat().nodes), 20), client.stat()
        assert client.stat().short == len(replicated)
    else:
        assert wait_until(lambda: not any(n.alive for n in client.stat().nodes if n.node_id == b), 20), client.stat()
    # New writes take A past its high watermark; B is dead and C full, so A must evict ~4 MiB.
    fresh = {f"new/{i:02d}": value(300 + i) for i in range(4)}
    for key, data in fresh.items():
        client.put(key, data, preferred_node=a)

    def lost() -> list[str]:  # a copy on B alone is none: B is dead (and soon reaped)
        return [k for k in replicated if not nodes_of(client, k) - {b}]

    def evicted_single() -> list[str]:
        return [k for k in single if client.object_meta(k) is None]

    assert wait_until(lambda: bool(lost() or evicted_single()), 20), "A evicted nothing"
    assert not lost(), f"last copies of replicas=2 objects evicted: {lost()}; replicas=1 ones gone: {evicted_single()}"
    assert evicted_single(), "A evicted no replicas=1 object"
    reader = make_client(cluster, timeout_s=10.0, transports=("tcp",))
    for key, data in {**replicated, **fresh}.items():
        assert np.array_equal(reader.get(key), data), key
