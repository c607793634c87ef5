"""Re-replication: an object that a dead node's purge leaves short of the replicas it was stored
with is copied to another node until it has its count again, so that the next node's loss loses
nothing either.

The index's part on the session's real Redis (scripts called directly, as an agent would), and the
whole of it with real agent processes (LocalCluster) killed with SIGKILL by their own pids."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import SilentPeer, node_row, pending_put, register_silent_node, wait_until
from index_audit import audit_index

from mooncake_store import Client, LocalCluster
from mooncake_store.agent.node import Agent
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


def replicas_of(client: Client, key: str) -> list[tuple[str, str]]:
    meta = client.object_meta(key)
    return [(r.node_id, str(r.tier)) for r in meta.replicas] if meta is not None else []


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
    assert index.counts(["B", "C", "D"])[2]["short"] == 1  # what stat shows as short
    assert index.repair_candidates("C") == []
    # The copy is added beside the source, which stays; a second call of the same copy is a retry.
    assert index.copy_replicas([("two", 2, replica("C", 20), "")], src_node="B") == ["OK"]
    assert index.copy_replicas([("two", 2, replica("C", 20), "")], src_node="B") == ["OK"]
    assert nodes_of(index, "two") == ["B", "C"]
    assert index.repair_candidates("B") == []  # its count is restored: it leaves the list
    assert index.counts(["B", "C", "D"])[2]["short"] == 0
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


def test_a_holder_that_moved_its_replica_away_and_died_hands_the_object_on(index: RedisIndex) -> None:
    """The purge handed on only the objects the dead node still held: one it was listed to copy
    but had spilled to C since was in no repair set after its death, short for good."""
    commit(index, "two", ("A", 1), ("B", 2))
    reap(index, "A")
    assert index.move_replicas([("two", 2, replica("C", 30), "")], old_node="B") == ["OK"]
    reap(index, "B")
    (cand,) = index.repair_candidates("C")
    assert (cand.key, cand.missing, cand.holders) == ("two", 1, ("C",))
    assert not audit_index(index)


def test_a_holder_late_with_its_heartbeat_at_the_purge_is_asked_once_back(index: RedisIndex) -> None:
    """With no holder live at the purge (A two seconds late, not yet reaped), the object was listed
    nowhere, and A's next heartbeat found nothing to copy."""
    commit(index, "lag", ("A", 1), ("B", 2))
    now = index.server_time_ms()
    index.redis.zadd(index.prefix + "hb", {"A": now - 2000, "B": 1})  # A late, B long dead
    assert index.reap_dead_nodes(grace_ms=30_000) == ["B"]
    index.redis.zadd(index.prefix + "hb", {"A": now + TTL_MS})  # A's next heartbeat
    assert [c.key for c in index.repair_candidates("A")] == ["lag"]


def test_a_holder_late_at_a_purge_counts_and_no_copy_is_made_too_many(index: RedisIndex) -> None:
    """B, late with its heartbeat (not yet reaped) when A was purged, was counted missing: C made
    two copies, and B's next heartbeat left the object with four replicas, stored with three."""
    tiers = (TierUsage(tier=TierKind.HOST, capacity_bytes=1 << 30, used_bytes=0),)
    index.register_node(node_row("E", tiers=tiers), incarnation="inc-E", ttl_ms=TTL_MS)
    commit(index, "three", ("A", 1), ("B", 2), ("C", 3))
    now = index.server_time_ms()
    index.redis.zadd(index.prefix + "hb", {"B": now - 1000, "A": 1})  # B a second late, A long dead
    assert index.reap_dead_nodes(grace_ms=30_000) == ["A"]
    (cand,) = index.repair_candidates("C")
    assert (cand.key, cand.missing) == ("three", 1)
    assert index.copy_replicas([("three", 3, replica("D", 30), "")], src_node="C") == ["OK"]
    # Whole as counted (B is back, or its purge will list the object again): no copy is added.
    assert index.copy_replicas([("three", 3, replica("E", 31), "")], src_node="C") == ["WHOLE"]
    index.redis.zadd(index.prefix + "hb", {"B": now + TTL_MS})  # B's next heartbeat
    assert nodes_of(index, "three") == ["B", "C", "D"]
    assert index.counts(["B", "C", "D", "E"])[2]["short"] == 0
    assert not audit_index(index)


def test_an_object_short_twice_is_listed_at_one_holder(index: RedisIndex) -> None:
    """Listed at B when A was purged, then at D when C was purged while B was late: both copied it
    (two replicas too many) and `short` counted it twice."""
    tiers = (TierUsage(tier=TierKind.HOST, capacity_bytes=1 << 30, used_bytes=0),)
    for node in "EFG":
        index.register_node(node_row(node, tiers=tiers), incarnation=f"inc-{node}", ttl_ms=TTL_MS)
    commit(index, "four", ("A", 1), ("B", 2), ("C", 3), ("D", 4))
    reap(index, "A")
    assert [c.key for c in index.repair_candidates("B")] == ["four"]
    now = index.server_time_ms()
    index.redis.zadd(index.prefix + "hb", {"B": now - 1000, "C": 1})
    assert index.reap_dead_nodes(grace_ms=30_000) == ["C"]
    index.redis.zadd(index.prefix + "hb", {"B": now + TTL_MS})  # B back
    live = ["B", "D", "E", "F", "G"]
    assert index.counts(live)[2]["short"] == 1
    assert index.repair_candidates("B") == []
    (cand,) = index.repair_candidates("D")
    assert (cand.key, cand.missing) == ("four", 2)
    # Copies made from either holder stop at the count.
    assert index.copy_replicas(
        [("four", 2, replica("E", 50), ""), ("four", 2, replica("F", 51), "")], src_node="B"
    ) == [
        "OK",
        "OK",
    ]
    assert index.copy_replicas([("four", 4, replica("G", 60), "")], src_node="D") == ["WHOLE"]
    assert nodes_of(index, "four") == ["B", "D", "E", "F"]
    assert index.counts(live)[2]["short"] == 0
    assert not audit_index(index)


def test_a_copy_dropped_under_pressure_is_listed_thinned(index: RedisIndex) -> None:
    """A full node's pass drops a copy (another node holds one): listed for repair, as a loss is,
    but marked thinned, so that the copy goes back only into room no pass takes back. It listed
    nothing: `short` said 0 while the object had one copy, and the next node's loss took it."""
    commit(index, "two", ("A", 1), ("B", 2))
    assert index.evict_many([("two", 1)], node_id="A") == ["OK"]
    (cand,) = index.repair_candidates("B")
    assert (cand.key, cand.missing, cand.holders, cand.thinned) == ("two", 1, ("B",), True)
    assert index.counts(["A", "B"])[2]["short"] == 1
    record = index.prefix + "o:two"
    assert index.redis.hget(record, "thinned") == "1"
    commit(index, "two", ("A", 8), ("B", 9))  # replaced: a new object, whole, marked nothing
    assert not index.redis.hexists(record, "thinned")
    assert index.repair_candidates("B") == []  # whole again: off the list
    # The holder's loss makes it urgent again: copied into any room under a high watermark.
    commit(index, "three", ("A", 3), ("B", 4), ("C", 5))
    assert index.evict_many([("three", 3)], node_id="A") == ["OK"]
    index.redis.zadd(index.prefix + "hb", {"C": 1})  # C past its deadline
    assert "C" in index.reap_dead_nodes(grace_ms=0)
    (cand,) = [c for c in index.repair_candidates("B") if c.key == "three"]
    assert (cand.missing, cand.thinned) == (2, False)
    assert not audit_index(index)


def test_a_damaged_replica_dropped_lists_the_object_with_a_sound_holder(index: RedisIndex) -> None:
    """A replica whose bytes failed their checksum is lost like a dead node's: dropping it left the
    object one copy short for good, with nothing listed."""
    commit(index, "two", ("A", 1), ("B", 2))
    assert index.drop_corrupt("two", 1, node_id="A")
    (cand,) = index.repair_candidates("B")
    assert (cand.key, cand.alloc_id, cand.missing, cand.holders) == ("two", 2, 1, ("B",))
    assert index.repair_candidates("A") == []
    assert not audit_index(index)


def test_a_peer_that_does_not_answer_a_copy_is_left_out_of_the_next_calls(
    direct_agent: Callable[..., Agent],
    client_of: Callable[[str], Client],
    namespace: str,
    silent_peer: SilentPeer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung peer that still heartbeats looks the emptiest: every repair call (each second) chose
    it and waited out the spill's timeout on its RESERVE (30 s; 1 s here), holding the pressure
    loop, and writers waiting for room, as long. Now it is left out for a heartbeat TTL."""
    from mooncake_store.agent import spill_jobs

    monkeypatch.setattr(spill_jobs, "TIMEOUT_S", 1.0)
    a = direct_agent(namespace, spill_shm=False)
    b = direct_agent(namespace)
    client = client_of(namespace)
    for i in range(4):
        client.put(f"s{i}", np.full(64 << 10, i, dtype=np.uint8), replicas=2, preferred_node=a.node_id)
    a.sync_once()
    b.sync_once()
    register_silent_node(b, silent_peer)
    a.index.redis.zadd(a.index.prefix + "hb", {b.node_id: 1})
    assert b.node_id in a.index.reap_dead_nodes(grace_ms=0)
    took = []
    for _ in range(3):
        started = time.monotonic()
        assert a.pressure.repairs.run_once(a.pressure.silent.now()) == 0  # the ghost is the only target
        took.append(time.monotonic() - started)
    assert len(silent_peer.accepted) == 1, f"the silent peer was asked again: {took}"
    assert max(took[1:]) < 0.5, f"repair calls waited on the silent peer: {took}"
    assert len(a.index.repair_candidates(a.node_id)) == 4  # still listed, for a peer that answers


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
    assert wait_until(lambda: writer.stat().short == 0, 5)  # listed until the next repair call
    # Now the node that held the other first copies: every object still has one elsewhere.
    second = {n for nodes in first.values() for n in nodes} - {"agent-0"}
    for node_id in sorted(second)[:1]:
        cluster.agent(node_id).kill()
    reader = make_client(cluster, timeout_s=5.0, transports=("tcp",))
    for key, value in values.items():
        assert np.array_equal(reader.get(key), value), key

    def copied() -> int:  # reaches the node table with each agent's next heartbeat
        return sum(t.copies_out for n in writer.stat().nodes if n.alive for t in n.tiers)

    # The second round of copies needs the second node's reap (2-3 s after its kill), a survivor's
    # repair call and each copier's next heartbeat: up to ~6 s, so waited for as long as the first.
    assert wait_until(lambda: copied() >= len(values), 20), f"{copied()} copies counted for {len(values)} objects"


def test_a_damaged_chunk_file_at_the_repair_source_is_dropped_not_sent_every_second(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    """A repair (like a spill) sends a chunk file as stored, and the peer decodes it whole: a damaged
    file was refused by the peer and sent again every second for good, while the index listed the
    damaged replica as readable. The source now checks a refused file, and a damaged one leaves
    the index as a read's would."""
    cluster = make_cluster(0, heartbeat_ttl_s=1.5)
    disk = ["--disk", str(tmp_path), "--disk-mem", str(64 * MiB)]
    cluster.add_agent(node_id="agent-0", extra_args=["--host-bytes", str(8 * MiB), *disk])
    for node_id in ("agent-1", "agent-2"):
        cluster.add_agent(node_id=node_id, extra_args=["--host-bytes", str(64 * MiB), *disk])
    client = make_client(cluster, lease_ms=300, timeout_s=10.0)
    values = {f"dd/{i:02d}": np.random.default_rng(i).integers(0, 255, MiB, dtype=np.uint8) for i in range(16)}
    for key, value in values.items():  # twice agent-0's host tier: its coldest go to its disk
        client.put(key, value, replicas=2, preferred_node="agent-0")

    def on_agent0_disk() -> list[str]:
        return [k for k in values if ("agent-0", "disk") in replicas_of(client, k)]

    assert wait_until(lambda: bool(on_agent0_disk()), 20), {k: replicas_of(client, k) for k in values}
    victim = on_agent0_disk()[0]
    meta = client.object_meta(victim)
    assert meta is not None
    (mine,) = (r for r in meta.replicas if r.node_id == "agent-0")
    (other,) = (r.node_id for r in meta.replicas if r.node_id != "agent-0")
    path = next((tmp_path / "agent-0").rglob(f"{mine.alloc_id:016x}.mcz"))
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x5A
    path.write_bytes(bytes(blob))
    cluster.agent(other).kill()  # agent-0 is to copy the victim, from its damaged file, to the last node
    stats = client.index.prefix + "stats"
    assert wait_until(lambda: int(client.index.redis.hget(stats, "corrupt") or 0) == 1, 20), client.stat()
    assert client.object_meta(victim) is None  # its one sound copy died with the other node: a loss
    assert wait_until(lambda: not path.exists(), 10), "the damaged file stayed after its replica went"
    live = {"agent-0", "agent-1", "agent-2"} - {other}
    assert wait_until(lambda: client.stat().short == 0, 20), client.stat()
    for key, value in values.items():
        if key != victim:
            assert len({n for n, _ in replicas_of(client, key)} & live) == 2, (key, replicas_of(client, key))
            assert np.array_equal(client.get(key), value), key


def test_a_repair_keeps_a_zone_spread_object_in_two_zones(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A put spreads replicas=2 over zones; a repair after one node's loss chose the source's zone
    first (as a spill does, for speed), so both copies sat in one zone and that zone's loss took
    the object. The copy goes to a zone that holds none."""
    cluster = make_cluster(0, heartbeat_ttl_s=1.5)
    zones = {"agent-0": "z1", "agent-1": "z1", "agent-2": "z2", "agent-3": "z2"}
    for node_id, zone in zones.items():
        cluster.add_agent(node_id=node_id, zone=zone)
    client = make_client(cluster, timeout_s=10.0)
    values = {f"zs/{i:02d}": np.random.default_rng(i).integers(0, 255, 64 << 10, dtype=np.uint8) for i in range(12)}
    client.put_many(values, replicas=2, preferred_node="agent-0")
    first = {k: nodes_of(client.index, k) for k in values}
    assert all(sorted(zones[n] for n in nodes) == ["z1", "z2"] for nodes in first.values()), first
    lost = sorted({n for nodes in first.values() for n in nodes} - {"agent-0"})[0]  # a z2 node
    cluster.agent(lost).kill()

    def repaired() -> bool:
        return all(len(set(nodes_of(client.index, k)) - {lost}) == 2 for k in values) and client.stat().short == 0

    assert wait_until(repaired, 30), {k: nodes_of(client.index, k) for k in values}
    after = {k: sorted(zones[n] for n in set(nodes_of(client.index, k)) - {lost}) for k in values}
    assert all(z == ["z1", "z2"] for z in after.values()), after


def test_a_full_batch_of_repairs_is_followed_at_once_and_done_keys_leave_the_list(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """Repairs took 256 objects a second per holder, and a repaired key left the holder's list only
    when a later random sample met it again, taking a short one's place: 12,000 small objects
    took over a minute and a half to be whole again. A copied key now leaves the list with its
    copy, and a call that took a full batch says there is more (the pressure loop calls again at
    its next turn)."""
    from mooncake_store.agent.repairs import REPAIR_BATCH

    a = direct_agent(namespace, spill_shm=False)
    b = direct_agent(namespace)
    client = client_of(namespace)
    count = REPAIR_BATCH + 44
    values = {f"many/{i:04d}": np.full(512, i % 251, np.uint8) for i in range(count)}
    client.put_many(values, replicas=2, preferred_node=a.node_id)  # every second copy on b
    c = direct_agent(namespace)  # where the copies go
    for agent in (a, b):
        agent.sync_once()
    a.index.redis.zadd(a.index.prefix + "hb", {b.node_id: 1})
    assert b.node_id in a.index.reap_dead_nodes(grace_ms=0)
    listed = a.index.prefix + "repair:" + a.node_id
    assert a.index.redis.scard(listed) == count
    survivors = {a.node_id, c.node_id}
    assert a.pressure.repairs.run_once(set()) == REPAIR_BATCH
    assert a.pressure.repairs.more
    assert a.index.redis.scard(listed) == count - REPAIR_BATCH  # the copied ones left with their copies
    assert a.pressure.repairs.run_once(set()) == count - REPAIR_BATCH
    assert not a.pressure.repairs.more and a.index.redis.scard(listed) == 0
    assert all(set(nodes_of(a.index, k)) == survivors for k in values)
    for key, value in list(values.items())[:: count // 10]:
        assert np.array_equal(client.get(key), value), key


@pytest.mark.parametrize(("ttl_s", "timeout_s"), [(1.5, 10.0), (8.0, 16.0), (60.0, 30.0)])
def test_a_call_to_a_peer_times_out_at_twice_the_heartbeat_ttl_within_bounds(
    make_inproc_agent: Callable[..., Agent], ttl_s: float, timeout_s: float
) -> None:
    """A repair (or spill) to a hung peer waited 30 s whatever the TTL, and the pressure loop with
    it: by twice the TTL the peer is past its deadline."""
    agent = make_inproc_agent(heartbeat_interval_s=min(1.0, ttl_s / 3), heartbeat_ttl_s=ttl_s)
    assert agent.pressure._spiller.transport._timeout_s == timeout_s
