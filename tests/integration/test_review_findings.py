"""Review findings: each test showed a defect before its fix (most of them breaches of a DESIGN.md
§3 invariant), and now guards against its return.

Some tests run the real Agent class in this process (its real server, allocation table, sync and
index scripts against the session's real Redis) so that an interleaving can be placed exactly,
by wrapping one method of its RedisIndex; the others use LocalCluster agent subprocesses.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import guarded_spill_copy, synced_after, wait_until, write_fenced

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.agent.node import Agent
from mooncake_store.client.cluster import AgentProcess
from mooncake_store.client.put_plans import PlannedPut
from mooncake_store.errors import ConnectError, ReservationExpired
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op
from mooncake_store.transport.tcp import TcpTransport, parse_endpoint
from mooncake_store.types import Replica, TierKind

MiB = 1 << 20
SIZE = 64 << 10


def _start_pending(client: Client, plan: PlannedPut) -> None:
    """Phase one of a put (the PENDING record), as the client's write path does it."""
    client.index.put_start([plan.pending()], ttl_ms=60_000)


@pytest.fixture
def inproc_agent(make_inproc_agent: Callable[..., Agent]) -> Agent:
    return make_inproc_agent()


@pytest.fixture
def inproc_client(inproc_agent: Agent, redis_url: str) -> Iterator[Client]:
    client = connect(redis_url, namespace=inproc_agent.namespace)
    try:
        yield client
    finally:
        client.close()


def _alloc_of(client: Client, key: str) -> int:
    meta = client.object_meta(key)
    assert meta is not None
    return meta.replicas[0].alloc_id


# ---------------------------------------------------------------------------------------------
def test_ack_of_reservation_newer_than_sync_snapshot_is_not_lost(inproc_agent: Agent, inproc_client: Client) -> None:
    agent, client = inproc_agent, inproc_client
    real_sync = agent.index.agent_sync
    fired = threading.Event()

    def sync_with_a_put_in_flight(*args, **kwargs):  # type: ignore[no-untyped-def]
        # A whole put (reserve, write, commit) lands between the deadline snapshot and the round trip.
        if not fired.is_set():
            fired.set()
            client.put("a", np.full(SIZE, 0xAA, dtype=np.uint8))
        return real_sync(*args, **kwargs)

    agent.index.agent_sync = sync_with_a_put_in_flight  # type: ignore[method-assign]
    agent.sync_once()
    agent.index.agent_sync = real_sync  # type: ignore[method-assign]
    alloc = _alloc_of(client, "a")
    time.sleep(0.7)  # past the reservation timeout
    agent.sync_once()
    # "a" is a committed, visible object: its allocation must still be held by the agent.
    client.put("b", np.full(SIZE, 0xBB, dtype=np.uint8))  # takes the freed block if "a"'s was freed
    got = client.get("a")
    assert (got == 0xAA).all(), f"get('a') returned bytes {bytes(got[:4])!r}... (those of 'b')"
    assert alloc in agent.table


# ---------------------------------------------------------------------------------------------
def test_concurrent_syncs_never_free_a_committed_reservation(inproc_agent: Agent, inproc_client: Client) -> None:
    agent, client = inproc_agent, inproc_client
    client.put("a", np.full(SIZE, 0xAA, dtype=np.uint8))  # committed; its ack is not drained yet
    alloc = _alloc_of(client, "a")
    time.sleep(0.7)  # the reservation is past its deadline in the agent's table (still RESERVED)
    real_sync = agent.index.agent_sync
    barrier = threading.Barrier(2)
    order = threading.Lock()

    def interleaved(*args, **kwargs):  # type: ignore[no-untyped-def]
        # Unsynchronised syncs would both arrive here with their snapshots taken; with the agent's
        # sync lock the second waits outside, the barrier breaks, and they run one after the other.
        try:
            barrier.wait(timeout=1.0)
        except threading.BrokenBarrierError:
            pass
        with order:
            return real_sync(*args, **kwargs)

    agent.index.agent_sync = interleaved  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            agent.sync_once()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    agent.index.agent_sync = real_sync  # type: ignore[method-assign]
    assert not errors
    client.put("b", np.full(SIZE, 0xBB, dtype=np.uint8))
    got = client.get("a")
    assert (got == 0xAA).all(), f"get('a') returned bytes {bytes(got[:4])!r}... (those of 'b')"
    assert alloc in agent.table


# ---------------------------------------------------------------------------------------------
def test_slow_tcp_write_cannot_overwrite_a_reused_block(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1, reserve_timeout_s=1.0)
    client = make_client(cluster)
    agent = cluster.agents[0]
    tcp = TcpTransport(timeout_s=10.0, connections_per_peer=1, stripe_bytes=1 << 30)
    sock = socket.create_connection(parse_endpoint(agent.endpoint), timeout=10)
    try:
        (res,) = tcp.peer(agent.endpoint).reserve([(SIZE, uuid.uuid4().bytes)], node_id=agent.node_id)
        junk = b"\xee" * SIZE
        sock.sendall(frames.pack(Op.WRITE, 0, res.alloc_id, res.offset, SIZE) + junk[: SIZE // 2])
        time.sleep(2.0)  # the slow writer's reservation expires: freed only once the write ends
        client.put("victim", np.full(SIZE, 0x11, dtype=np.uint8))
        sock.sendall(junk[SIZE // 2 :])
        _, status, *_ = frames.unpack(frames.recv_exact(sock, frames.HEADER_BYTES))
        assert status == frames.Status.STALE  # the write that outlived its reservation is void
    finally:
        sock.close()
        tcp.close()
    assert (client.get("victim") == 0x11).all()


# ---------------------------------------------------------------------------------------------
def test_reaped_agent_does_not_free_reservations_of_puts_in_flight(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    node_id = cluster.agents[0].node_id
    puts = client._puts
    (plan,) = puts.plan({"a": np.full(SIZE, 0xAA, dtype=np.uint8)}, chain_pos=None, chain_parent=None)
    nodes = puts.reserver.reserve([plan], 1, None)
    _start_pending(client, plan)
    # The agent stalls past its deadline and a peer reaps it (forced here: deadline 0, grace 0).
    r = client.index.redis
    r.zadd(client.index.prefix + "hb", {node_id: 0})
    assert node_id in client.index.reap_dead_nodes(grace_ms=0)
    # It heartbeats again, learns it was reaped, drops everything and registers again.
    assert wait_until(lambda: node_id in client.index.nodes(), 5.0)
    time.sleep(0.5)
    # The writer, unaware, writes (same host: under the agent's fence, which may refuse it) and commits.
    with contextlib.suppress(ReservationExpired):
        write_fenced(puts, nodes[node_id], [(plan.replicas[0], plan)])
    # The re-registered agent's next sync revokes the reservation it expired (waited for: a sync
    # late on a loaded machine would let the commit win, as it should then).
    assert wait_until(synced_after(client, node_id), 10)
    statuses = client.index.put_commit([plan.put_id.hex()])
    # The late commit fails instead of naming reusable memory: revoked (EXPIRED), or refused for
    # naming the previous incarnation's alloc (GONE), whichever the re-registered agent's sync left.
    assert statuses in (["EXPIRED"], ["GONE"])
    client.put("b", np.full(SIZE, 0xBB, dtype=np.uint8))
    assert not client.exists("a")
    assert (client.get("b") == 0xBB).all()


# ---------------------------------------------------------------------------------------------
def test_chain_children_count_survives_parent_restore(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    value = np.zeros(1024, dtype=np.uint8)
    client.put_many({"p": value}, chain_pos={"p": 0})
    client.put_many({"c": value}, chain_pos={"c": 1}, chain_parent={"c": "p"})
    r, prefix = client.index.redis, client.index.prefix
    assert int(r.hget(prefix + "children", "p")) == 1
    client.remove("p")  # e.g. its node died and was reaped; "c" lives on
    client.put_many({"p": value}, chain_pos={"p": 0})  # the prefix store writes the missing chunk again
    children_after_restore = int(r.hget(prefix + "children", "p") or 0)
    client.remove("c")
    children_after_child_gone = int(r.hget(prefix + "children", "p") or 0)
    assert (children_after_restore, children_after_child_gone) == (1, 0)


# ---------------------------------------------------------------------------------------------
def _guarded_spill_copy(client: Client, a: AgentProcess, b: AgentProcess) -> tuple[Replica, Replica, str]:
    return guarded_spill_copy(client, a, b, size=SIZE)


# ---------------------------------------------------------------------------------------------
def test_spill_swap_after_peer_reclaimed_its_reservation_is_refused(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, reserve_timeout_s=1.0)
    client = make_client(cluster)
    a, b = cluster.agents
    old, new, put_id = _guarded_spill_copy(client, a, b)
    time.sleep(2.0)  # the copy was slow: b reclaims the reservation it never heard about
    (status,) = client.index.move_replicas([("obj", old.alloc_id, new, put_id)], old_node=a.node_id)
    # Accepting this swap would make "obj" name memory b has freed (and will hand to the next put).
    assert status == "EXPIRED"
    assert client.object_meta("obj").replicas[0].node_id == a.node_id  # type: ignore[union-attr]


def test_commit_to_a_node_that_left_the_table_fails(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1, heartbeat_ttl_s=1.5)
    client = make_client(cluster)
    agent = cluster.agents[0]
    puts = client._puts
    (plan,) = puts.plan({"late": np.full(SIZE, 0x5A, dtype=np.uint8)}, chain_pos=None, chain_parent=None)
    puts.reserver.reserve([plan], 1, None)
    _start_pending(client, plan)
    agent.kill()  # dies for good: nobody revokes the pending record
    assert wait_until(lambda: agent.node_id in client.index.reap_dead_nodes(grace_ms=0), 5.0)
    assert client.index.put_commit([plan.put_id.hex()]) == ["GONE"]
    assert not client.exists("late")
    assert not client.index.redis.exists(client.index.prefix + "nobj:" + agent.node_id)


# ---------------------------------------------------------------------------------------------
def test_spill_never_puts_two_replicas_of_an_object_on_one_node(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0)
    cluster.add_agent(node_id="agent-0", extra_args=["--host-bytes", str(8 * MiB)])
    cluster.add_agent(node_id="agent-1", extra_args=["--host-bytes", str(160 * MiB)])
    client = make_client(cluster, lease_ms=200, timeout_s=20)
    keys = [f"r2/{i:03d}" for i in range(24)]  # 24 MiB: three times agent-0's arena
    for key in keys:
        client.put(key, np.full(MiB, 7, dtype=np.uint8), replicas=2)

    def collapsed() -> list[str]:
        out = []
        for key in keys:
            meta = client.object_meta(key)
            if meta is not None and len({r.node_id for r in meta.replicas}) < len(meta.replicas):
                out.append(key)
        return out

    wait_until(lambda: bool(collapsed()), 3.0)
    bad = collapsed()
    assert not bad, f"{len(bad)} replicas=2 object(s) hold both replicas on one node, e.g. {bad[0]!r}: " + str(
        [(r.node_id, str(r.tier)) for r in client.object_meta(bad[0]).replicas]  # type: ignore[union-attr]
    )


# ---------------------------------------------------------------------------------------------
def test_spill_swap_to_a_reaped_peer_is_refused(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    # A 3 s TTL: a, reaped with grace 0 while alive, would be too if one of its heartbeats (every
    # second) came 0.5 s late, as with a 1.5 s one on a loaded machine.
    cluster = make_cluster(2, heartbeat_ttl_s=3.0)
    client = make_client(cluster)
    a, b = cluster.agents
    old, new, put_id = _guarded_spill_copy(client, a, b)
    # b dies before the swap, and is reaped; the guard lives on (b's sync is gone with b).
    b.kill()
    assert wait_until(lambda: b.node_id in client.index.reap_dead_nodes(grace_ms=0), 10.0)
    (status,) = client.index.move_replicas([("obj", old.alloc_id, new, put_id)], old_node=a.node_id)
    assert status != "OK", "the swap moved 'obj' onto a node that left the node table"
    assert client.exists("obj")  # its bytes are still on a: an object never removed stays readable


# ---------------------------------------------------------------------------------------------
@pytest.fixture
def disk_agent(make_inproc_agent: Callable[..., Agent], tmp_path: Path) -> Agent:
    """An in-process Agent with a disk tier; its pressure loop stays idle (low usage)."""
    return make_inproc_agent(host_bytes=8 << 20, reserve_timeout_s=5.0, disk_path=str(tmp_path), disk_bytes=64 << 20)


def test_promotion_whose_swap_fails_does_not_leak_its_host_block(disk_agent: Agent, redis_url: str) -> None:
    agent = disk_agent
    client = connect(redis_url, namespace=agent.namespace, lease_ms=100)
    try:
        client.put("cold", np.full(SIZE, 0x3C, dtype=np.uint8))
        agent.sync_once()  # the put's ack: its block is committed
        (victim,) = agent.index.victim_candidates(agent.node_id, str(TierKind.HOST))
        location = agent.table.offset_of(victim.alloc_id)
        assert location is not None
        assert agent.pressure.moves.demote_to_disk(victim, location[0])  # now on disk only
        time.sleep(0.2)
        agent.sync_once()  # the old host block was buried: freed now
        assert len(agent.table) == 0

        real_move, real_promote = agent.index.move_replica, agent.pressure.moves.promote
        promoted = threading.Event()

        def index_times_out(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise ConnectError("index timed out")

        def promote_then_tell(*args, **kwargs):  # type: ignore[no-untyped-def]
            # The agent promotes after the read's reply went out: the swap must meet the timeout
            # above however late that runs (a fixed sleep let a late one meet the real index).
            try:
                return real_promote(*args, **kwargs)
            finally:
                promoted.set()

        agent.index.move_replica = index_times_out  # type: ignore[method-assign]
        agent.pressure.moves.promote = promote_then_tell  # type: ignore[method-assign]
        try:
            assert (client.get("cold") == 0x3C).all()  # read from disk; the promotion's swap fails
            assert promoted.wait(10), "the read from disk was never promoted"
        finally:
            agent.index.move_replica = real_move  # type: ignore[method-assign]
            agent.pressure.moves.promote = real_promote  # type: ignore[method-assign]
        meta = client.object_meta("cold")
        assert meta is not None and meta.replicas[0].tier == TierKind.DISK  # the swap did not land
        time.sleep(0.3)
        agent.sync_once()
        named = {r.alloc_id for r in meta.replicas}
        leaked = agent.table.known_ids() - named
        assert not leaked, f"host allocation(s) {sorted(leaked)} held, named by no object, never freed"
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------
def test_drop_everything_keeps_a_reservation_granted_during_it(make_inproc_agent: Callable[..., Agent]) -> None:
    """_drop_everything now runs under the table's lock in one step (drop_after_reap), so no RESERVE
    can land between deciding what is reserved and freeing the rest; check the step's outcome."""
    agent = make_inproc_agent(reserve_timeout_s=30.0)
    tcp = TcpTransport(timeout_s=10.0, connections_per_peer=1, stripe_bytes=1 << 30)
    try:
        (res,) = tcp.peer(agent.server.endpoint).reserve([(SIZE, uuid.uuid4().bytes)], node_id=agent.node_id)
        (done,) = agent.table.reserve([(SIZE, b"c" * 16)]) or []
        agent.table.commit([done.alloc_id])
        agent._drop_everything()  # the heartbeat thread, after learning the node was reaped
        agent.table.hold_reaped({})  # registered again: no read lease runs on what the purge took
    finally:
        tcp.close()
    # A reservation of a put in flight is only expired (the next sync revokes its pending record
    # first), never freed under its writer; a committed allocation (gone from the index) is freed.
    assert res.alloc_id in agent.table, "the in-flight reservation was freed at once; its block is reusable"
    assert done.alloc_id not in agent.table
