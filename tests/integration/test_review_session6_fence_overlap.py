"""Review of 315b880: same-host puts overlapped FENCE with put_start and UNFENCE with put_commit, and
no longer used the UNFENCE verdict, which let a reservation freed before put_start be committed
(fixed: the verdict is read again, before put_commit; the FENCE overlap stays) (client/puts.py
_put_once; client/replica_writes.py fence, copy_fenced, check_landed; transport/fence.py
Fence, transport/tcp.py PeerConnections.fenced). Real in-process Agents (their sync runs when the test says), real
sockets, real shm, the real index; faults are injected around the component, never instead of it."""

from __future__ import annotations

import socket
import time
import uuid
from typing import Any

import numpy as np
import pytest
from helpers import held_fences, run_in_threads, wait_until

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.errors import ConnectError, MooncakeError, TransferError
from mooncake_store.transport import fence as fence_module
from mooncake_store.transport.tcp import PeerConnections, TcpTransport
from mooncake_store.transport.tcp_pool import _readable

KiB = 1 << 10
MiB = 1 << 20


def pool_of(c: Client, agent: Agent) -> PeerConnections:
    return c._tcp.peer(agent.server.endpoint)


def assert_pool_clean(c: Client, agent: Agent) -> None:
    """No pooled connection holds an unread reply (or was closed under the pool)."""
    peer = pool_of(c, agent)
    with peer._lock:
        idle = [s for s, _ in peer._idle]
    assert not [s for s in idle if _readable(s)], "a connection went back to the pool with bytes unread"
    assert peer.ping() > 0


def pending_records(agent: Agent) -> list[str]:
    return list(agent.index.redis.scan_iter(match=agent.index.prefix + "pend:*"))


def object_alloc_held(c: Client, agent: Agent, key: str) -> bool:
    meta = c.object_meta(key)
    assert meta is not None, f"{key!r} is not stored"
    return all(r.alloc_id in agent.table for r in meta.replicas if r.node_id == agent.node_id)


def reap_and_rejoin(agent: Agent) -> None:
    """What a peer's reaper and the agent's next heartbeat do to a stalled agent, in place: the
    record is purged, the agent drops everything (its reservations only expire) and registers again
    under the same incarnation (Agent.heartbeat_once)."""
    index = agent.index
    # The agent's own heartbeat thread (every second) may move the deadline back between the two
    # calls: then the reap finds it alive, and is tried again.
    for _ in range(10):
        index.redis.zadd(index.prefix + "hb", {agent.node_id: 0})
        if agent.node_id in index.reap_dead_nodes(grace_ms=0):
            break
    else:
        raise AssertionError(f"{agent.node_id} was never reaped")
    agent.heartbeat_once()


# ---- the safety argument: "the agent frees a reservation only after a revoke" ------------------
@pytest.mark.parametrize("how", ["reservation-timeout", "reap"])
def test_reservation_freed_before_put_start_is_never_committed(make_inproc_agent, clients, monkeypatch, how) -> None:
    """The agent's sync runs while the writer's put_start is on its way (the writer stalled past the
    reservation timeout, or the node was reaped and re-registered meanwhile). The sync finds no
    pending record yet ("G": already gone) and frees the reservation; the FENCE, sent before
    put_start, got there first, so the free is only deferred (doomed) and happens at UNFENCE, whose
    verdict (False) the put no longer reads. put_start then records the put and put_commit, which
    finds the record, says OK: the object names memory the agent has freed."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=0.3)
    c = clients(agent, transports=("shm", "tcp"))
    c.put("warm", np.ones(4 * KiB, np.uint8))  # the arena is mapped, the node table read
    real_put_start = c.index.put_start
    calls: list[int] = []

    def stalled_put_start(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            wait_until(lambda: held_fences(agent) > 0, 1.0)  # the FENCE (if any) has landed
            if how == "reap":
                reap_and_rejoin(agent)
            else:
                time.sleep(0.5)  # past the reservation's deadline
            agent.sync_once()  # the agent's sync tick, while this put_start is still on its way
        return real_put_start(*args, **kwargs)

    monkeypatch.setattr(c.index, "put_start", stalled_put_start)
    value = np.full(64 * KiB, 0x5A, np.uint8)
    try:
        c.put("x", value)
    except MooncakeError as exc:  # refusing the put is a correct outcome too
        print("put refused:", type(exc).__name__, exc)
        assert not c.exists("x")
        return
    assert held_fences(agent) == 0
    held = object_alloc_held(c, agent, "x")
    # What follows from it: the freed block goes to the next object, and "x" reads its bytes.
    c.put("y", np.full(64 * KiB, 0x33, np.uint8))
    got = c.get("x")
    assert held, (
        "put('x') was reported stored, but the agent no longer holds its reservation: after a put "
        f"of 'y' (0x33), {int((got != value).sum())} of x's {value.size} bytes are not x's"
    )
    assert np.array_equal(got, value)


def put_placed_twice_and_whole(c: Client, agent: Agent, calls: list[int], why: str) -> None:
    """Put "x" through a stalled first attempt (``calls`` counts the attempts): it is placed again,
    names a live reservation, keeps its bytes when the next object takes the freed block, and
    leaves no fence and no dirty pooled connection behind."""
    value = np.full(64 * KiB, 0x5A, np.uint8)
    c.put("x", value)
    assert len(calls) == 2, why
    assert object_alloc_held(c, agent, "x")
    c.put("y", np.full(64 * KiB, 0x33, np.uint8))
    assert np.array_equal(c.get("x"), value)
    assert held_fences(agent) == 0
    assert_pool_clean(c, agent)


def test_reservation_revoked_after_put_start_makes_the_put_retry(make_inproc_agent, clients, monkeypatch) -> None:
    """The "R" half of the argument, which does hold: the sync revokes the pending record while the
    fence is held; the copy goes into the doomed (not yet freed) block, put_commit says EXPIRED and
    the put is placed again. The stored object names a live reservation."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=0.3)
    c = clients(agent, transports=("shm", "tcp"))
    c.put("warm", np.ones(4 * KiB, np.uint8))
    real_put_start = c.index.put_start
    calls: list[int] = []

    def put_start_then_stall(*args: Any, **kwargs: Any) -> Any:
        out = real_put_start(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.5)
            agent.sync_once()  # revokes the pending record: "R"
        return out

    monkeypatch.setattr(c.index, "put_start", put_start_then_stall)
    put_placed_twice_and_whole(c, agent, calls, "the put was not placed again after its reservation was revoked")


def test_reservation_freed_before_the_fence_makes_the_put_retry(make_inproc_agent, clients, monkeypatch) -> None:
    """The writer stalls between RESERVE and FENCE past the reservation timeout and the sync frees
    the reservation ("G": no pending record): the FENCE is refused, the put is placed again, and
    the stored object names a live reservation."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=0.3)
    c = clients(agent, transports=("shm", "tcp"))
    c.put("warm", np.ones(4 * KiB, np.uint8))
    puts = c._puts
    real_fence = puts.writes.fence
    calls: list[int] = []

    def stalled_fence(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.5)
            agent.sync_once()
        return real_fence(*args, **kwargs)

    monkeypatch.setattr(puts.writes, "fence", stalled_fence)
    put_placed_twice_and_whole(c, agent, calls, "the put was not placed again after its FENCE was refused")


# ---- error paths between FENCE and its reply, and around put_commit -----------------------------
@pytest.mark.parametrize("error", [ConnectError("index unreachable (injected)"), KeyboardInterrupt()])
def test_put_start_failing_lifts_the_fence(make_inproc_agent, clients, monkeypatch, error) -> None:
    """The FENCE went out, put_start raises before its reply is read: the fence connection is
    closed (the agent lifts the fence), nothing pending is left, the reservation is reclaimed,
    and the pool holds no connection with the FENCE reply unread."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=0.3)
    c = clients(agent, transports=("shm", "tcp"))
    c.put("warm", np.ones(4 * KiB, np.uint8))
    before = agent.table.known_ids()
    real_put_start = c.index.put_start

    def failing_put_start(*args: Any, **kwargs: Any) -> Any:
        assert wait_until(lambda: held_fences(agent) == 1, 5), "the FENCE was not sent before put_start"
        raise error

    monkeypatch.setattr(c.index, "put_start", failing_put_start)
    with pytest.raises(type(error)):
        c.put("x", np.full(64 * KiB, 7, np.uint8))
    monkeypatch.setattr(c.index, "put_start", real_put_start)
    assert wait_until(lambda: held_fences(agent) == 0, 5), "the fence outlived the failed put"
    assert not pending_records(agent)
    time.sleep(0.4)
    agent.sync_once()
    assert agent.table.known_ids() == before, "the failed put's reservation was not reclaimed"
    assert_pool_clean(c, agent)
    c.put("x", np.full(64 * KiB, 8, np.uint8))
    assert (c.get("x") == 8).all()


def test_put_commit_failing_lifts_the_fence(make_inproc_agent, clients, monkeypatch) -> None:
    """UNFENCE sent, put_commit raises before it reaches the index: the fence is lifted, the
    pending record revoked, the reservation reclaimed, and no object appears."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=0.3)
    c = clients(agent, transports=("shm", "tcp"))
    c.put("warm", np.ones(4 * KiB, np.uint8))
    before = agent.table.known_ids()

    def failing_put_commit(*args: Any, **kwargs: Any) -> Any:
        raise ConnectError("index unreachable (injected)")

    monkeypatch.setattr(c.index, "put_commit", failing_put_commit)
    with pytest.raises(ConnectError):
        c.put("x", np.full(64 * KiB, 7, np.uint8))
    monkeypatch.undo()
    assert wait_until(lambda: held_fences(agent) == 0, 5)
    assert not c.exists("x") and not pending_records(agent)
    time.sleep(0.4)
    agent.sync_once()
    assert agent.table.known_ids() == before
    assert_pool_clean(c, agent)


def test_fence_connection_breaking_before_the_reply_fails_the_put_cleanly(
    make_inproc_agent, clients, monkeypatch
) -> None:
    """The fence's connection breaks while put_start is under way (the client's end is shut down
    under it): reading the FENCE reply fails, the put raises a MooncakeError, nothing is copied or
    committed, the agent lifts the fence, and the next put works."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=0.3)
    c = clients(agent, transports=("shm", "tcp"))
    c.put("warm", np.ones(4 * KiB, np.uint8))
    real_put_start = c.index.put_start
    made: list[Any] = []
    real_init = fence_module.Fence.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        made.append(self)

    def breaking_put_start(*args: Any, **kwargs: Any) -> Any:
        for fence in made:
            fence._sock.shutdown(socket.SHUT_RDWR)
        return real_put_start(*args, **kwargs)

    monkeypatch.setattr(fence_module.Fence, "__init__", recording_init)
    monkeypatch.setattr(c.index, "put_start", breaking_put_start)
    with pytest.raises(MooncakeError):
        c.put("x", np.full(64 * KiB, 7, np.uint8))
    assert made, "no Fence was made for a same-host put"
    monkeypatch.undo()
    assert not c.exists("x")
    assert wait_until(lambda: held_fences(agent) == 0, 5)
    assert_pool_clean(c, agent)
    c.put("x", np.full(64 * KiB, 8, np.uint8))
    assert (c.get("x") == 8).all()


def test_agent_that_does_not_own_the_segment_gets_the_bytes_over_tcp(make_inproc_agent, clients, monkeypatch) -> None:
    """The FENCE reply names another arena: the put writes over TCP (while its fence on the same
    reservations is held on another connection of the same agent), the bytes land, the fence
    is lifted, and the pool is clean."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=30.0)
    c = clients(agent, transports=("shm", "tcp"))
    monkeypatch.setattr(fence_module, "segment_digest", lambda name: 12345)
    values = {f"k{i}": np.full(16 * KiB + i, i + 1, np.uint8) for i in range(5)}
    c.put_many(values)
    for k, v in values.items():
        assert np.array_equal(c.get(k), v)
        assert object_alloc_held(c, agent, k)
    assert held_fences(agent) == 0
    assert_pool_clean(c, agent)


# ---- connections: pooled back clean, bounded under concurrency -------------------------------
def test_fence_connections_go_back_to_the_pool_with_nothing_unread(make_inproc_agent, clients) -> None:
    """Every put reads its UNFENCE reply (before put_commit) before the connection is pooled: a
    run of puts reuses a few connections, none holding an unread byte."""
    agent = make_inproc_agent(host_bytes=8 * MiB, reserve_timeout_s=30.0)
    c = clients(agent, transports=("shm", "tcp"))
    for i in range(50):
        c.put(f"k{i}", np.full(4 * KiB, i, np.uint8))
        assert_pool_clean(c, agent)
    assert len(agent.server._conns) <= 4, f"{len(agent.server._conns)} connections for one writer thread"
    for i in range(50):
        assert (c.get(f"k{i}") == i).all()
    assert held_fences(agent) == 0


def test_many_threads_two_same_host_agents_replicas_2(make_peer_agent, clients) -> None:
    """Sixteen threads share one client, each putting batches with two replicas on two same-host
    agents (fences on both held across put_start): all land, every object names live memory on
    both, no fence is left, and the connections stay bounded by the threads."""
    a = make_peer_agent(host_bytes=32 * MiB, spill_to_peers=False)
    b = make_peer_agent(host_bytes=32 * MiB, spill_to_peers=False)
    c = clients(a, transports=("shm", "tcp"))

    def worker(t: int) -> None:
        for i in range(10):
            batch = {f"t{t}-{i}-{j}": np.full(8 * KiB, (t * 7 + i + j) % 256, np.uint8) for j in range(3)}
            c.put_many(batch, replicas=2)

    errors = run_in_threads(worker, 16, timeout_s=60)
    assert not errors, errors[:3]
    for t in range(16):
        key = f"t{t}-9-2"
        assert (c.get(key) == (t * 7 + 9 + 2) % 256).all()
        assert object_alloc_held(c, a, key) and object_alloc_held(c, b, key)
    assert held_fences(a) == 0 and held_fences(b) == 0
    for agent in (a, b):
        assert len(agent.server._conns) <= 3 * 16, f"{len(agent.server._conns)} connections for 16 threads"
        assert_pool_clean(c, agent)


# ---- the spill's PeerConnections.fenced, rebuilt on Fence: verdicts as before --------------------
def test_peer_fenced_reports_a_reservation_freed_during_the_copy(make_inproc_agent) -> None:
    """PeerConnections.fenced still reads the UNFENCE verdict: a reservation the agent freed while
    it was fenced (doomed) is reported not landed, and freed once the fence lifts; an arena that is
    not the caller's gives None with nothing copied; a copy that raises lifts the fence."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=30.0)
    tcp = TcpTransport(timeout_s=10.0, connections_per_peer=1, stripe_bytes=1 << 30)
    try:
        peer = tcp.peer(agent.server.endpoint)
        res = peer.reserve([(4 * KiB, uuid.uuid4().bytes), (4 * KiB, uuid.uuid4().bytes)], node_id=agent.node_id)
        ids = [r.alloc_id for r in res]

        def copy_and_free_one(fenced: list[bool]) -> list[bool]:
            assert fenced == [True, True] and held_fences(agent) == 2
            agent.table.free([ids[1]])  # a reaper's free while the copy runs: only doomed
            assert ids[1] in agent.table
            return [True, True]

        assert peer.fenced(ids, agent.arena.name, copy_and_free_one) == [True, False]
        assert ids[1] not in agent.table, "the doomed reservation was not freed when its fence lifted"
        assert held_fences(agent) == 0

        copied: list[bool] = []
        assert peer.fenced([ids[0]], "not-" + agent.arena.name, lambda f: copied.append(True) or f) is None
        assert not copied and held_fences(agent) == 0

        def failing_copy(fenced: list[bool]) -> list[bool]:
            raise OSError("copy failed (injected)")

        # (Before 315b880 the copy's OSError came back as a TransferError, from inside _call; it
        # now comes back as it was raised. The spill's own copy raises none: numpy copyto.)
        with pytest.raises((OSError, TransferError), match="injected"):
            peer.fenced([ids[0]], agent.arena.name, failing_copy)
        assert wait_until(lambda: held_fences(agent) == 0, 5)
        assert ids[0] in agent.table
        with peer._lock:
            assert not [s for s, _ in peer._idle if _readable(s)]
    finally:
        tcp.close()


def test_zero_size_values_take_no_fence(make_inproc_agent, clients) -> None:
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=30.0)
    c = clients(agent, transports=("shm", "tcp"))
    c.put("empty", np.zeros(0, np.uint8))
    assert not agent.server._fences or held_fences(agent) == 0
    assert c.get("empty").size == 0
    assert_pool_clean(c, agent)
