"""Re-replication: an object that a dead node's purge leaves short of the replicas it was stored
with is copied to another node until it has its count again, so that the next node's loss loses
nothing either.

The index's part on the session's real Redis (scripts called directly, as an agent would), and the
whole of it with real agent processes (LocalCluster) killed with SIGKILL by their own pids."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import node_row, pending_put, wait_until
from index_audit import audit_index

from mooncake_store import Client, LocalCluster
from mooncake_store.index.client import RedisIndex
from mooncake_store.types import Replica, ReplicaState, TierKind, TierUsage

TTL_MS = 600_000
MiB = 1 << 20


@pytest.fixture
def index(redis_url: str) -> Iterator[RedisIndex]:
    idx = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}", timeout_s=60.0)
    tiers = (TierUsage(tier=TierKind.HOST, capacity_bytes=1 << 30, used_bytes=0),)
    try:
        for node in ("A", "B", "C", "D"):
            idx.register_node(node_row(node, tiers=tiers), incarnation=f"inc-{node}", ttl_ms=TTL_MS)
        yield idx
    finally:
        idx.close()


def replica(node: str, alloc: int) -> Replica:
    return Replica(
        node_id=node, tier=TierKind.HOST, offset=0, size_bytes=16, alloc_id=alloc, state=ReplicaState.COMPLETE
    )


def commit(index: RedisIndex, key: str, *placed: tuple[str, int]) -> None:
    put = pending_put(key, *((node, TierKind.HOST, alloc) for node, alloc in placed))
    index.put_start([put], ttl_ms=TTL_MS)
    assert index.put_commit([put.put_id]) == ["OK"]


def reap(index: RedisIndex, node: str) -> None:
    index.redis.zadd(index.prefix + "hb", {node: 1})  # its heartbeat deadline long past
    assert index.reap_dead_nodes(grace_ms=0) == [node]


def nodes_of(index: RedisIndex, key: str) -> list[str]:
    meta = index.lookup([key], lease_ms=0).objects[0]
    return sorted(r.node_id for r in meta.replicas) if meta is not None else []


def test_a_purge_lists_what_it_left_short_and_a_copy_restores_it(index: RedisIndex) -> None:
    commit(index, "two", ("A", 1), ("B", 2))
    commit(index, "one", ("A", 3))  # stored with one replica: lost with A, nothing to repair
    commit(index, "elsewhere", ("B", 4), ("C", 5))  # A held none of it
    assert index.repair_candidates("B") == []
    reap(index, "A")
    assert nodes_of(index, "one") == []
    (cand,) = index.repair_candidates("B")
    assert (cand.key, cand.alloc_id, cand.tier, cand.missing, cand.holders) == ("two", 2, TierKind.HOST, 1, ("B",))
    assert index.repair_candidates("C") == []
    # The copy is added beside the source, which stays; a second call of the same copy is a retry.
    assert index.copy_replicas([("two", 2, replica("C", 20), "")], src_node="B") == ["OK"]
    assert index.copy_replicas([("two", 2, replica("C", 20), "")], src_node="B") == ["OK"]
    assert nodes_of(index, "two") == ["B", "C"]
    assert index.repair_candidates("B") == []  # its count is restored: it leaves the list
    assert not index.redis.exists(index.prefix + "repair:B")
    # A node with a replica already, or the source's own node, is no target; a source gone is GONE.
    assert index.copy_replicas([("two", 2, replica("C", 21), "")], src_node="B") == ["DUP"]
    assert index.copy_replicas([("two", 2, replica("B", 22), "")], src_node="B") == ["DUP"]
    assert index.copy_replicas([("two", 99, replica("D", 23), "")], src_node="B") == ["GONE"]
    assert not audit_index(index)


def test_a_holder_that_dies_before_it_copies_hands_the_object_on(index: RedisIndex) -> None:
    commit(index, "three", ("A", 1), ("B", 2), ("C", 3))
    reap(index, "A")
    assert [c.key for c in index.repair_candidates("B")] == ["three"]
    reap(index, "B")  # before it made the copy: the next live holder is to make both
    (cand,) = index.repair_candidates("C")
    assert (cand.key, cand.missing, cand.holders) == ("three", 2, ("C",))
    assert not index.redis.exists(index.prefix + "repair:B")
    assert not audit_index(index)


def test_an_eviction_under_pressure_lists_nothing(index: RedisIndex) -> None:
    """Pressure drops a replica on purpose (another node holds one): copying it back would undo it."""
    commit(index, "two", ("A", 1), ("B", 2))
    assert index.evict_many([("two", 1)], node_id="A") == ["OK"]
    assert index.repair_candidates("B") == []


def test_objects_stay_readable_through_the_loss_of_their_nodes_one_after_another(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """With replicas=2 and no re-replication, the second node's loss took every object whose two
    copies sat on the two nodes lost: a rolling restart lost data."""
    cluster = make_cluster(4, heartbeat_ttl_s=1.5)
    writer = make_client(cluster, timeout_s=5.0)
    values = {f"rr/{i:02d}": np.random.default_rng(i).integers(0, 255, MiB, dtype=np.uint8) for i in range(24)}
    writer.put_many(values, replicas=2, preferred_node="agent-0")
    first = {k: nodes_of(writer.index, k) for k in values}
    assert all(len(nodes) == 2 and "agent-0" in nodes for nodes in first.values()), first

    def restored(dead: set[str]) -> bool:
        return all(len(set(nodes_of(writer.index, k)) - dead) == 2 for k in values)

    cluster.agent("agent-0").kill()
    assert wait_until(lambda: restored({"agent-0"}), 20), {k: nodes_of(writer.index, k) for k in values}
    # Now the node that held the other first copies: every object still has one elsewhere.
    second = {n for nodes in first.values() for n in nodes} - {"agent-0"}
    for node_id in sorted(second)[:1]:
        cluster.agent(node_id).kill()
    reader = make_client(cluster, timeout_s=5.0, transports=("tcp",))
    for key, value in values.items():
        assert np.array_equal(reader.get(key), value), key

    def copied() -> int:  # reaches the node table with each agent's next heartbeat
        return sum(t.copies_out for n in writer.stat().nodes if n.alive for t in n.tiers)

    assert wait_until(lambda: copied() >= len(values), 5), f"{copied()} copies counted for {len(values)} objects"
