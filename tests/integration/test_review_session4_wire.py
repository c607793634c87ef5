"""Review of the agent's wire protocol (session 4, wire): agent/server.py, agent/inbox.py and the
agent hooks in agent/node.py, driven with hand-made frames over real loopback sockets.

Each test fails on the code as reviewed, for the reason its docstring gives. Real Agents in this
process (make_inproc_agent) against the session's real Redis-compatible server; every wait is
bounded, and every socket is closed by the test that opened it.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import connect
from mooncake_store.agent import inbox as inbox_module
from mooncake_store.agent import server as server_module
from mooncake_store.agent.node import Agent
from mooncake_store.errors import MooncakeError, NoCapacity
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.transport import frames
from mooncake_store.transport.frames import SPILL_FLAG, TIER_DISK, Op, Status
from mooncake_store.transport.tcp import PeerConnections, parse_endpoint

KiB = 1 << 10
MiB = 1 << 20


def test_a_reserve_larger_than_the_arena_evicts_nothing(
    make_inproc_agent: Callable[..., Agent], redis_url: str
) -> None:
    """One RESERVE frame asking for 1 TiB on a 4 MiB agent can never be granted; it must be refused
    (NO_CAPACITY) and cost nothing else. The server passes the size to no_room(), the pressure
    thread wants 1 TiB of room (_arena_need: wanted - largest_free) and evicts every movable object
    of the node, far below its watermark: a single bad frame drops every object stored there."""
    ns = f"t-{uuid.uuid4().hex[:10]}"
    agent = make_inproc_agent(namespace=ns, host_bytes=4 * MiB, reserve_timeout_s=30.0)
    client = connect(redis_url, namespace=ns, timeout_s=10, transports=("tcp",))
    keys = [f"k{i}" for i in range(4)]
    # Host passes the pressure thread has made (it makes one per wake and per interval).
    passes: list[int] = []
    relieve_host = agent.pressure.relieve_host

    def counted_pass() -> int:
        moved = relieve_host()
        passes.append(moved)
        return moved

    agent.pressure.relieve_host = counted_pass  # type: ignore[method-assign]
    try:
        for i, key in enumerate(keys):
            client.put(key, np.full(64 * KiB, i, np.uint8))  # 256 KiB of 4 MiB: no pressure at all
        assert all(client.object_meta(k) is not None for k in keys)
        before = len(passes)
        with socket.create_connection(parse_endpoint(agent.server.endpoint), timeout=5) as sock:
            sock.sendall(frames.pack(Op.RESERVE, 1, 0, 0) + frames.RESERVE_ENTRY.pack(1 << 40, b"x" * 16))
            _, status, _, _, capacity = frames.unpack(frames.recv_exact(sock, frames.HEADER_BYTES))
        assert status == Status.NO_CAPACITY and capacity == 4 * MiB
        # Passes begun after the refusal: several, whether or not it woke the thread.
        assert wait_until(lambda: len(passes) >= before + 3, 10), "the pressure thread made no passes"
        gone = [k for k in keys if client.object_meta(k) is None]
        assert not gone, f"a refused 1 TiB RESERVE on a 4 MiB node evicted {gone}"
        for i, key in enumerate(keys):
            assert client.get(key).tolist() == [i] * (64 * KiB)
    finally:
        client.close()


def test_running_out_of_file_descriptors_does_not_kill_the_accept_loop(
    make_inproc_agent: Callable[..., Agent], caplog: pytest.LogCaptureFixture
) -> None:
    """accept() failing with EMFILE (one client holding many idle connections, which the server
    keeps forever and does not cap) is transient: once descriptors are free again the agent must
    serve new connections. _accept_loop returns on any OSError from accept(), so the agent never
    accepts again: every later connection sits in the backlog and each request times out."""
    agent = make_inproc_agent()
    caplog.set_level(logging.WARNING, logger="mooncake.agent")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    sock: socket.socket | None = None
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        for _ in range(64):  # bounded: fill every descriptor this process may still open
            try:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        os.close(fillers.pop())  # one free slot, which the client end of a connection takes
        sock = socket.create_connection(parse_endpoint(agent.server.endpoint), timeout=2)
        # The accept thread wakes for it and gets EMFILE (which it logs) before a descriptor frees.
        failed = wait_until(lambda: any("accept failed" in r.getMessage() for r in caplog.records), 10)
    finally:
        if sock is not None:
            sock.close()
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert failed, "accept() never failed: the case was not reached"
    peer = PeerConnections(agent.server.endpoint, timeout_s=2, max_idle=1)
    try:
        assert wait_until(agent.server._accept_thread.is_alive, 1), "the accept loop died on EMFILE"
        assert peer.ping() == frames.VERSION
    finally:
        peer.close()


def test_a_disk_write_too_large_to_stage_leaks_no_fence(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spill reservation on the disk tier is bounded only by disk_bytes, and a WRITE into it
    stages the whole file in DRAM (inbox.staging: bytearray(length)) after begin_write has fenced
    it. When that allocation fails (MemoryError, here 1 PiB) nothing lifts the fence: the
    connection thread dies with a traceback (_serve catches only MooncakeError/OSError), the
    reservation keeps readers=1, and a FREE followed by a sync only dooms it. It stays in the
    inbox for good and its 1 PiB counts against the disk's free room for the agent's life."""
    disk_bytes = 1 << 52
    # A disk tier larger than its filesystem is refused at start; here the filesystem's size is not
    # the point (one larger than memory has the same staging problem), the fence is.
    monkeypatch.setattr(DiskTier, "_check_room", staticmethod(lambda root, capacity_bytes: None))
    agent = make_inproc_agent(disk_path=str(tmp_path), disk_bytes=disk_bytes)
    assert agent.inbox is not None
    # A reservation larger than any file the agent takes is refused now (the next test); here the
    # inbox is made to take any, as it did then: the fence on a MemoryError is what is tested.
    agent.inbox.largest_file = None
    agent.inbox._staging_limit = 1 << 62
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    try:
        (res,) = peer.reserve([(1 << 50, b"s" * 16)], node_id=agent.node_id, tier=TIER_DISK, flags=SPILL_FLAG)
        with socket.create_connection(parse_endpoint(agent.server.endpoint), timeout=5) as sock:
            sock.sendall(frames.pack(Op.WRITE, 0, res.alloc_id, res.offset, 1 << 50))
            try:
                reply = sock.recv(frames.HEADER_BYTES)  # refused (a reply) or closed: either will do
            except OSError:
                reply = b""
        assert reply == b"" or frames.unpack(reply)[1] != Status.OK
        assert peer.free([res.alloc_id]) == 1  # the writer gives the reservation up
        agent.sync_once()  # no commit reached the index: the sync frees it
        assert res.alloc_id not in agent.inbox, "the abandoned disk reservation is still fenced"
        assert agent.disk is not None and agent.disk.free_bytes == disk_bytes
    finally:
        peer.close()


def test_disk_reservations_and_files_in_memory_are_bounded_by_the_largest_file_the_agent_takes(
    make_inproc_agent: Callable[..., Agent],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A disk reservation was bounded only by the disk's room, and a WRITE into one zero-fills a
    buffer of its whole size before any byte arrives: a peer's 100-byte frames made the agent
    allocate up to 90% of --disk-mem in RAM (four 100 MiB reservations took an agent from 49 to
    449 MiB), though no file larger than its largest memory tier is ever taken. Such a reservation
    is refused now, and files in memory at once are bounded (one always fits)."""
    monkeypatch.setattr(inbox_module, "STAGING_BYTES", 1 << 20)
    agent = make_inproc_agent(host_bytes=4 << 20, disk_path=str(tmp_path), disk_bytes=512 << 20)
    assert agent.inbox is not None and agent.inbox.largest_file is not None
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    try:
        with pytest.raises(NoCapacity):
            peer.reserve([(100 << 20, b"b" * 16)], node_id=agent.node_id, tier=TIER_DISK, flags=SPILL_FLAG)
        size = 3 << 20  # two of them are past the bound (the largest file, ~4 MiB here)
        first, second = peer.reserve(
            [(size, b"1" * 16), (size, b"2" * 16)], node_id=agent.node_id, tier=TIER_DISK, flags=SPILL_FLAG
        )
        address = parse_endpoint(agent.server.endpoint)
        with socket.create_connection(address, timeout=5) as held, socket.create_connection(address, timeout=5) as late:
            held.sendall(frames.pack(Op.WRITE, 0, first.alloc_id, first.offset, size))  # staged: bytes to come
            assert wait_until(lambda: first.alloc_id in agent.inbox._staged, 5)
            with caplog.at_level(logging.INFO, logger="mooncake.agent"):
                late.sendall(frames.pack(Op.WRITE, 0, second.alloc_id, second.offset, size) + bytes(size))
                assert frames.unpack(late.recv(frames.HEADER_BYTES))[1] == Status.STALE  # drained, not staged
            assert any(
                f"{second.alloc_id} refused: {size} B of files arriving" in r.getMessage() for r in caplog.records
            )
            assert second.alloc_id not in agent.inbox._staged
        assert wait_until(lambda: not agent.inbox._staged, 5), "a broken-off WRITE left its bytes counted"
    finally:
        peer.close()


def test_disk_reservations_shorter_than_a_chunk_file_header_are_refused(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A spill onto the disk tier reserves room for a chunk file, which is never shorter than its
    header: zero-size entries could only fill the inbox with 8192 reservations per frame."""
    agent = make_inproc_agent(disk_path=str(tmp_path), disk_bytes=64 << 20)
    assert agent.inbox is not None
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    try:
        with pytest.raises(MooncakeError):
            peer.reserve(
                [(0, b"z%015d" % i) for i in range(8192)], node_id=agent.node_id, tier=TIER_DISK, flags=SPILL_FLAG
            )
        assert len(agent.inbox.table) == 0
        (res,) = peer.reserve([(4096, b"y" * 16)], node_id=agent.node_id, tier=TIER_DISK, flags=SPILL_FLAG)
        assert res.alloc_id in agent.inbox  # a real size still reserves
    finally:
        peer.close()


def test_connections_past_the_limit_are_closed_and_the_agent_keeps_serving(
    make_inproc_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One thread per connection: past MAX_CONNECTIONS a new connection is not served (one that
    sends nothing is closed after REFUSE_WAIT_S; a request would get BUSY first); once one of the
    open ones goes, new connections are served again."""
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 4)
    agent = make_inproc_agent()
    address = parse_endpoint(agent.server.endpoint)
    held = [socket.create_connection(address, timeout=5) for _ in range(4)]
    try:
        assert wait_until(lambda: len(agent.server._conns) == 4, 5)
        with socket.create_connection(address, timeout=5) as extra:
            assert extra.recv(1) == b"", "a connection past the limit was served"
        held.pop().close()
        assert wait_until(lambda: len(agent.server._conns) == 3, 5)
        peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=1)
        try:
            assert peer.ping() == frames.VERSION
        finally:
            peer.close()
    finally:
        for sock in held:
            sock.close()


def test_idle_connections_are_closed_and_the_client_pool_reconnects(
    make_inproc_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent closes connections idle past IDLE_CLOSE_S (forgotten pools must not hold the
    connection limit); a client's pooled connection the agent closed is dropped when next taken,
    not used for a request that would fail."""
    monkeypatch.setattr(server_module, "IDLE_CLOSE_S", 0.3)
    agent = make_inproc_agent()
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    try:
        assert peer.ping() == frames.VERSION
        assert wait_until(lambda: len(agent.server._conns) == 0, 5), "an idle connection was not closed"
        assert peer.ping() == frames.VERSION  # a new connection, not the closed one
    finally:
        peer.close()


def test_a_small_file_that_decodes_large_counts_its_plain_bytes_against_the_bound(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A received file is checked by decoding it whole: a few hundred bytes of zstd frame that
    declare the largest size taken made the agent hold that much per connection, with nothing
    bounding the sum. Its plain bytes count against the bound on files in memory now: with 3 MiB
    arriving on another connection, a 2 MiB (plain) file of zeros is refused, and placed again by
    its sender; alone, it is taken."""
    monkeypatch.setattr(inbox_module, "STAGING_BYTES", 1 << 20)
    agent = make_inproc_agent(host_bytes=4 << 20, disk_path=str(tmp_path / "agent"), disk_bytes=512 << 20)
    assert agent.inbox is not None
    maker = DiskTier(tmp_path / "maker", 64 << 20)
    blob, _ = maker.encode(memoryview(bytes(2 << 20)), itemsize=1)
    maker.close()
    assert len(blob) < 64 << 10  # zeros: the file is small, its plain bytes are not
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    address = parse_endpoint(agent.server.endpoint)

    def send_file() -> int:
        (res,) = peer.reserve(
            [(len(blob), uuid.uuid4().bytes)], node_id=agent.node_id, tier=TIER_DISK, flags=SPILL_FLAG
        )
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(frames.pack(Op.WRITE, 0, res.alloc_id, res.offset, len(blob)) + blob)
            return frames.unpack(sock.recv(frames.HEADER_BYTES))[1]

    try:
        (held,) = peer.reserve([(3 << 20, b"h" * 16)], node_id=agent.node_id, tier=TIER_DISK, flags=SPILL_FLAG)
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(frames.pack(Op.WRITE, 0, held.alloc_id, held.offset, 3 << 20))  # bytes to come
            assert wait_until(lambda: held.alloc_id in agent.inbox._staged, 5)
            assert send_file() == Status.STALE
        assert wait_until(lambda: not agent.inbox._staged, 5)
        assert send_file() == Status.OK
    finally:
        peer.close()


def test_a_busy_refused_chunk_file_longer_than_the_host_arena_keeps_its_stream(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's chunk file may be longer than the host arena (the zstd bound of the largest memory
    tier). Refused while others arrive, such a WRITE was answered STALE and its connection closed
    undrained, for a WRITE longer than the arena: the sender took its stream for broken, gave the
    batch up and left this peer out for a while. It is drained now, the connection kept."""
    monkeypatch.setattr(inbox_module, "STAGING_BYTES", 1 << 20)
    agent = make_inproc_agent(host_bytes=4 << 20, disk_path=str(tmp_path), disk_bytes=512 << 20)
    assert agent.inbox is not None and agent.inbox.largest_file is not None
    size = agent.inbox.largest_file
    assert size > agent.arena.size_bytes
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    address = parse_endpoint(agent.server.endpoint)
    try:
        first, second = peer.reserve(
            [(size, b"1" * 16), (size, b"2" * 16)], node_id=agent.node_id, tier=TIER_DISK, flags=SPILL_FLAG
        )
        with socket.create_connection(address, timeout=5) as held, socket.create_connection(address, timeout=5) as late:
            held.sendall(frames.pack(Op.WRITE, 0, first.alloc_id, first.offset, size))  # bytes to come
            assert wait_until(lambda: first.alloc_id in agent.inbox._staged, 5)
            late.sendall(frames.pack(Op.WRITE, 0, second.alloc_id, second.offset, size) + bytes(size))
            assert frames.unpack(late.recv(frames.HEADER_BYTES))[1] == Status.STALE
            late.sendall(frames.pack(Op.PING))  # the same connection, in step
            assert frames.unpack(late.recv(frames.HEADER_BYTES))[1] == Status.OK
    finally:
        peer.close()
