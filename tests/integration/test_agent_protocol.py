"""Hostile frames on the agent's port: each is refused without harming the agent or its data."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import xxhash
from patched_agent import wait_committed

from mooncake_store import Client, LocalCluster
from mooncake_store.errors import ProtocolError, StaleLocation, TransferError
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import PeerConnections, parse_endpoint


def _connect(cluster: LocalCluster) -> socket.socket:
    sock = socket.create_connection(parse_endpoint(cluster.agents[0].endpoint), timeout=5)
    return sock


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def one_agent(make_cluster) -> LocalCluster:  # type: ignore[no-untyped-def]
    return make_cluster(1)


def test_garbage_closes_only_that_connection(one_agent: LocalCluster, make_client) -> None:  # type: ignore[no-untyped-def]
    client: Client = make_client(one_agent, transports=("tcp",))
    client.put("safe", np.arange(1000, dtype=np.int32))
    # Not our magic: closed without a word. Our magic in another version, or an op this agent does
    # not know: one BAD_REQUEST reply in the agent's version (a = that version), then the close.
    for junk, answered in (
        (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 20, False),
        (b"MC\x09" + b"\x00" * 29, True),
        (frames.pack(99), True),
    ):
        with _connect(one_agent) as sock:
            sock.sendall(junk)
            if answered:
                _, status, version, _, _ = frames.unpack(sock.recv(frames.HEADER_BYTES, socket.MSG_WAITALL))
                assert (status, version) == (Status.BAD_REQUEST, frames.VERSION)
            assert _closed(sock)
    assert client.get("safe").tolist() == list(range(1000))


def test_oversized_batches_are_refused(one_agent: LocalCluster) -> None:
    for op in (Op.RESERVE, Op.FREE):
        with _connect(one_agent) as sock:
            sock.sendall(frames.pack(op, frames.MAX_BATCH + 1))
            _, status, *_ = frames.unpack(frames.recv_exact(sock, frames.HEADER_BYTES))
            assert status == Status.BAD_REQUEST
            assert _closed(sock)


def test_reads_and_writes_outside_an_allocation_are_stale(one_agent: LocalCluster, make_client) -> None:  # type: ignore[no-untyped-def]
    client: Client = make_client(one_agent, transports=("tcp",))
    client.put("obj", np.full(4096, 5, np.uint8))
    (meta,) = client.index.lookup(["obj"], lease_ms=0).objects
    assert meta is not None
    replica = meta.replicas[0]
    assert wait_committed(one_agent, replica.alloc_id)  # the agent learns of it at its next sync
    peer = PeerConnections(one_agent.agents[0].endpoint, timeout_s=5, max_idle=2)
    try:
        ok = bytearray(4096)
        peer.read_many([frames_read(replica.alloc_id, replica.offset, ok)])
        assert ok == b"\x05" * 4096
        with pytest.raises(StaleLocation):  # unknown generation
            peer.read_many([frames_read(replica.alloc_id + 12345, replica.offset, bytearray(16))])
        with pytest.raises(StaleLocation):  # past the end of the allocation
            peer.read_many([frames_read(replica.alloc_id, replica.offset + 4000, bytearray(200))])
        with pytest.raises(StaleLocation):  # committed bytes are never rewritten
            peer.write(replica.alloc_id, replica.offset, memoryview(b"\x00" * 16))
        with pytest.raises((StaleLocation, TransferError, ProtocolError)):  # beyond the arena
            peer.write(replica.alloc_id, 1 << 40, memoryview(b"\x00" * 16))
        assert peer.free([replica.alloc_id]) == 0  # a client may not free a committed object
        with pytest.raises(StaleLocation):  # a fresh reservation cannot be written past its end
            (res,) = peer.reserve([(64, b"p" * 16)], node_id="agent-0")
            peer.write(res.alloc_id, res.offset + 32, memoryview(b"\x00" * 64))
    finally:
        peer.close()
    assert client.get("obj").tolist() == [5] * 4096


def frames_read(alloc_id: int, offset: int, dest: bytearray):  # type: ignore[no-untyped-def]
    from mooncake_store.transport.tcp import ReadRequest

    return ReadRequest(alloc_id=alloc_id, offset=offset, dest=memoryview(dest))


def test_pipelined_writes_land_in_order_and_a_refused_one_spoils_nothing(one_agent: LocalCluster) -> None:
    """write_many keeps several WRITE frames in flight on one connection: the acks come back in
    order, a refused write (STALE) is drained by the agent and the writes after it still land."""
    peer = PeerConnections(one_agent.agents[0].endpoint, timeout_s=5, max_idle=2)
    try:
        sizes = [4096, 100_000, 1 << 20, 64, 300_000]
        reservations = peer.reserve([(n, bytes([i]) * 16) for i, n in enumerate(sizes)], node_id="agent-0")
        payloads = [np.full(n, i + 1, np.uint8) for i, n in enumerate(sizes)]
        requests = [(r.alloc_id, r.offset, memoryview(p)) for r, p in zip(reservations, payloads, strict=True)]
        # The third goes to an allocation that does not exist: refused, its 1 MiB drained.
        requests[2] = (reservations[2].alloc_id + 999_999, reservations[2].offset, memoryview(payloads[2]))
        assert peer.write_many(requests, window=3) == [True, True, False, True, True]
        for r, p, ok in zip(reservations, payloads, [True, True, False, True, True], strict=True):
            got = bytearray(len(p))
            peer.read_many([frames_read(r.alloc_id, r.offset, got)])
            assert (bytes(got) == p.tobytes()) == ok
        assert peer.ping() == frames.VERSION  # the connection is still in step
        assert peer.free([r.alloc_id for r in reservations]) == len(sizes)
    finally:
        peer.close()


def test_digest_is_the_checksum_of_what_landed_and_stale_outside_a_live_reservation(one_agent: LocalCluster) -> None:
    """DIGEST (what a TCP writer commits as its checksum) hashes the reservation's bytes as they are
    in the arena; behind a WRITE on the same connection it answers after the WRITE's ack. It is
    STALE for an unknown allocation, a range past the reservation's end, and a refused WRITE, and
    the connection stays in step after each."""
    peer = PeerConnections(one_agent.agents[0].endpoint, timeout_s=5, max_idle=2)
    try:
        size = (1 << 20) + 64
        (res,) = peer.reserve([(size, b"d" * 16)], node_id="agent-0")
        payload = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        landed = peer.write(res.alloc_id, res.offset, memoryview(payload), digest=True)
        assert landed == xxhash.xxh3_64_intdigest(payload)
        assert peer.digest(res.alloc_id, res.offset, size) == landed
        assert peer.digest(res.alloc_id, res.offset + 64, 4096) == xxhash.xxh3_64_intdigest(payload[64 : 64 + 4096])
        with pytest.raises(StaleLocation):  # no such allocation
            peer.digest(res.alloc_id + 12345, res.offset, 16)
        with pytest.raises(StaleLocation):  # past the end of the reservation
            peer.digest(res.alloc_id, res.offset + size - 8, 16)
        with pytest.raises(StaleLocation):  # a refused WRITE: its DIGEST is read and refused too
            peer.write(res.alloc_id + 12345, res.offset, memoryview(payload[:4096]), digest=True)
        assert peer.ping() == frames.VERSION  # the connection is still in step
        assert peer.free([res.alloc_id]) == 1
    finally:
        peer.close()


def test_a_silent_agent_is_a_clear_timeout_not_a_hang() -> None:
    """Client sockets are blocking with kernel timeouts (no poll() per chunk): an agent that accepts
    and then says nothing must still end the call after timeout_s, with a message that says so."""
    listener = socket.create_server(("127.0.0.1", 0))
    peer = PeerConnections(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.5, max_idle=1)
    try:
        started = time.monotonic()
        with pytest.raises(TransferError, match=r"made no progress for 0.5 s"):
            peer.ping()
        assert time.monotonic() - started < 5
    finally:
        peer.close()
        listener.close()


def test_a_request_that_stalls_midway_is_dropped_and_its_fence_lifted(make_inproc_agent) -> None:  # type: ignore[no-untyped-def]
    """The agent's server bounds each recv of a request under way: a writer that stops halfway
    through a WRITE loses its connection, the reservation's write fence is lifted, and the
    reservation takes a whole write afterwards. (A second server on the same agent, with a short
    timeout, so that the test does not wait the agent's 30 s.)"""
    from mooncake_store.agent.server import AgentServer

    agent = make_inproc_agent()
    server = AgentServer("127.0.0.1:0", agent.arena, agent.table, timeout_s=0.5, hooks=agent)
    server.start()
    peer = PeerConnections(server.endpoint, timeout_s=5, max_idle=2)
    try:
        (res,) = peer.reserve([(1 << 20, b"s" * 16)], node_id=agent.node_id)
        with socket.create_connection(parse_endpoint(server.endpoint), timeout=5) as sock:
            sock.sendall(frames.pack(Op.WRITE, 0, res.alloc_id, res.offset, 1 << 20) + b"x" * 1000)
            started = time.monotonic()
            assert _closed(sock)  # after about the server's 0.5 s
            assert time.monotonic() - started < 5
        payload = np.full(1 << 20, 7, np.uint8)
        peer.write(res.alloc_id, res.offset, memoryview(payload))  # the fence is gone: this lands
        got = bytearray(1 << 20)
        peer.read_many([frames_read(res.alloc_id, res.offset, got)])
        assert bytes(got) == payload.tobytes()
    finally:
        peer.close()
        server.stop()


def test_a_connection_whose_thread_cannot_start_is_told_busy_and_the_agent_still_stops_clean(
    make_inproc_agent, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Under a process or memory limit (a container's pids.max) starting a connection's thread
    fails. The server kept the never-started thread in its list: the client got a reset, and at
    stop() joining it raised, which skipped the rest of Agent.stop(), so the arena's segment
    stayed in /dev/shm. Now the connection is told BUSY (the client backs off and retries) and the
    agent stops clean. The failure is the thread start's own RuntimeError, for mc-conn threads."""
    import threading

    from mooncake_store.tiers.host import SHM_DIR

    agent = make_inproc_agent()
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "mc-conn":
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with socket.create_connection(parse_endpoint(agent.server.endpoint), timeout=5) as sock:
        sock.sendall(frames.pack(Op.PING))
        op, status, *_ = frames.unpack(frames.recv_exact(sock, frames.HEADER_BYTES))
    assert (op, status) == (Op.PING | frames.REPLY_BIT, Status.BUSY)
    monkeypatch.undo()
    segment = SHM_DIR / agent.arena.name
    assert segment.exists()
    agent.stop()  # raised RuntimeError: cannot join thread before it is started
    assert not segment.exists(), f"{segment} left behind by the agent's stop()"
