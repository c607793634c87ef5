"""Review of the agent's handling of hostile, malformed or unlucky traffic (session 8, wire):
agent/server.py, agent/allocations.py and transport/frames.py, driven over real loopback sockets
against real agent subprocesses.

Agents run as their own processes (LocalCluster's command line, through ``python -c``): a few
module constants of agent/server.py and agent/ops.py (MAX_CONNECTIONS, IDLE_CLOSE_S, MIN_RATE_BPS, its socket
buffer size, the server's per-call timeout) and the process's descriptor limit are set in that
process before ``main()`` runs, so that limits are reached in seconds instead of minutes. Nothing
of the component under test is replaced.

Tests that failed on the code as reviewed (each docstring says why):
- test_a_client_turned_away_at_the_connection_limit_is_told_the_limit
- test_connections_past_the_descriptor_limit_are_refused_not_left_hanging
- test_a_write_trickled_one_byte_per_timeout_does_not_hold_its_reservation_forever
- test_a_peer_speaking_another_version_or_op_is_told_before_the_close
and, added with the fixes: a WRITE turned away at the limit still gets its reply; a READ whose
reader trickles its reply out is cut off too; a long train of small READs on one connection
(read_many) does not deadlock on full socket buffers.

The others guard behaviour worth keeping: refused, idle and half-open connections leak no thread
or socket; a torn WRITE, a cut RESERVE and an unread RESERVE reply leave the arena as it was; a READ
outlives a concurrent free with the original bytes; fences are per connection; u64 fields at their
limits are refused cleanly.
"""

from __future__ import annotations

import logging
import re
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import wait_until
from patched_agent import agent_address, agent_side_sockets, connect_raw, read_reply, wait_committed

from mooncake_store import Client, LocalCluster
from mooncake_store.errors import ConnectError, MooncakeError
from mooncake_store.tiers.host import segment_digest
from mooncake_store.transport import frames, tcp
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import PeerConnections, ReadRequest

KiB = 1 << 10
MiB = 1 << 20
U64_MAX = (1 << 64) - 1


# ---- helpers --------------------------------------------------------------------------------------


def _closed_by_agent(sock: socket.socket) -> bool:
    """Whether the agent closed (or reset) this connection; blocks up to the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _agent_threads(cluster: LocalCluster) -> int:
    with open(f"/proc/{cluster.agents[0].pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads: line")


def _published_used(client: Client) -> tuple[int, float]:
    """Used bytes of the agent's host tier as its latest heartbeat published them, and that
    heartbeat's age in seconds."""
    (node,) = client.stat().nodes
    return next(t.used_bytes for t in node.tiers if t.tier == "host"), node.heartbeat_age_s


def _host_used(client: Client, timeout_s: float = 6.0) -> int:
    """Used bytes of the agent's host tier, from a heartbeat sent after this call began (the
    agent publishes its use once a second)."""
    start = time.monotonic()
    while True:
        used, age_s = _published_used(client)
        if age_s < time.monotonic() - start - 0.05 or time.monotonic() - start > timeout_s:
            return used
        time.sleep(0.1)


def _used_becomes(client: Client, expected: int, timeout_s: float = 8.0) -> bool:
    """Whether a heartbeat sent after this call began publishes ``expected`` used bytes."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        used, age_s = _published_used(client)
        if used == expected and age_s < time.monotonic() - start - 0.05:
            return True
        time.sleep(0.2)
    return False


def _healthy(client: Client, seed: int) -> None:
    """A normal client still stores and reads back bytes exactly."""
    value = np.random.default_rng(seed).integers(0, 256, 300 * KiB, dtype=np.uint8)
    key = f"health-{seed}"
    client.put(key, value)
    assert bytes(client.get(key).tobytes()) == value.tobytes()


def _peer(cluster: LocalCluster) -> PeerConnections:
    return PeerConnections(cluster.agents[0].endpoint, timeout_s=5, max_idle=2)


def _read(peer: PeerConnections, alloc_id: int, offset: int, length: int) -> bytearray:
    out = bytearray(length)
    peer.read_many([ReadRequest(alloc_id=alloc_id, offset=offset, dest=memoryview(out))])
    return out


# ---- the connection limit -------------------------------------------------------------------------
def test_a_client_turned_away_at_the_connection_limit_is_told_the_limit(
    start_agent: Callable[..., LocalCluster],
) -> None:
    """DESIGN.md §3.6: bad input gets a MooncakeError whose message names the value and the limit.
    Past MAX_CONNECTIONS the accept loop closed the new connection without a word, so the client's
    request died with "peer closed the connection after 0 of 32 B" (or a reset): nothing said the
    agent was full, let alone at what limit, and an operator looked for a crashed or misbehaving
    agent instead. Now the agent reads the request and answers BUSY with the limit, and the client
    raises ConnectError naming the agent and the limit. A WRITE whose payload is larger than the
    socket buffers gets it too: the agent reads and drops the payload until the client has read
    the reply, instead of closing on unread bytes (a reset, which the client would see instead)."""
    cluster = start_agent({"MAX_CONNECTIONS": 4})
    held: list[socket.socket] = []
    peer = _peer(cluster)
    try:
        for _ in range(4):
            sock = connect_raw(cluster)
            held.append(sock)
            sock.sendall(frames.pack(Op.PING))
            assert read_reply(sock)[1] == Status.OK  # served: it counts against the limit
        with pytest.raises(MooncakeError) as info:
            peer.ping()
        message = str(info.value)
        assert re.search(r"\blimit\b", message) and re.search(r"\b4\b", message), (
            f"a client past the agent's 4-connection limit was told only: {message!r}"
        )
        assert isinstance(info.value, ConnectError) and cluster.agents[0].endpoint in message
        payload = np.zeros(32 * MiB, np.uint8)  # more than the client's and the agent's buffers hold
        with pytest.raises(ConnectError, match=r"connection limit of 4\b"):
            peer.write(12345, 0, memoryview(payload))
    finally:
        peer.close()
        for sock in held:
            sock.close()


def test_refused_idle_and_half_open_connections_leak_nothing(start_agent: Callable[..., LocalCluster]) -> None:
    """Connections refused at the limit are answered BUSY and closed at once, and cost no thread;
    idle ones are closed after IDLE_CLOSE_S, and one that sent half a header after the server's timeout, so a
    client that opened the limit's worth and went quiet starves others only until then. Once all
    are gone, the agent's thread count and its connections are back to where they started."""
    cluster = start_agent({"MAX_CONNECTIONS": 4, "IDLE_CLOSE_S": 1.0, "timeout_s": 1.0})
    threads_before = _agent_threads(cluster)
    held: list[socket.socket] = []
    try:
        for i in range(4):
            sock = connect_raw(cluster)
            held.append(sock)
            if i == 0:
                sock.sendall(frames.pack(Op.PING)[:10])  # half a header, then silence
            else:
                sock.sendall(frames.pack(Op.PING))
                assert read_reply(sock)[1] == Status.OK
        for _ in range(30):  # each turned away at once
            with connect_raw(cluster) as extra:
                extra.sendall(frames.pack(Op.PING))
                assert read_reply(extra)[:3] == (Op.PING | frames.REPLY_BIT, Status.BUSY, 4)
                assert _closed_by_agent(extra)
        # The idle ones (1 s) and the half-open one (the server's 1 s timeout) are closed by the agent.
        for sock in held:
            assert _closed_by_agent(sock), "an idle or half-open connection was kept"
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: agent_side_sockets(cluster) == 0, 5), "the agent kept sockets"
    assert wait_until(lambda: _agent_threads(cluster) == threads_before, 5), "the agent kept threads"
    peer = _peer(cluster)
    try:
        assert peer.ping() == frames.VERSION
    finally:
        peer.close()


def test_connections_past_the_descriptor_limit_are_refused_not_left_hanging(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """MAX_CONNECTIONS (4096) is checked, but nothing relates it to the process's descriptor limit:
    at the common soft limit of 1024 (here 96, the same thing sooner) accept() fails with EMFILE
    long before the limit, the accept loop only logs and retries every ACCEPT_RETRY_S, and every
    new connection sits in the listen backlog: its request is neither served nor refused, and the
    client hangs for its whole timeout_s (then TransferTimeout, "made no progress"). A connection
    the agent cannot serve must be turned away promptly, as at MAX_CONNECTIONS."""
    cluster = start_agent({"nofile": 96})
    client = make_client(cluster, transports=("tcp",))
    held: list[socket.socket] = []
    hung_at: int | None = None
    try:
        for i in range(130):  # bounded: past 96 descriptors, whatever the agent had open before
            sock = connect_raw(cluster, timeout_s=3.0)
            held.append(sock)
            sock.sendall(frames.pack(Op.PING))
            try:
                answered = sock.recv(frames.HEADER_BYTES, socket.MSG_WAITALL)
            except ConnectionResetError:
                answered = b""
            except TimeoutError:
                hung_at = i
                break
            if answered == b"" or frames.unpack(answered)[1] == Status.BUSY:
                break  # turned away: the right outcome once the agent is full
    finally:
        for sock in held:
            sock.close()
    _healthy(client, 1)  # the agent serves again once the connections are gone
    emfile = cluster.agents[0].log_tail(200_000).count("accept failed")
    assert hung_at is None, (
        f"connection {hung_at} got neither a reply nor a close within 3 s: the agent ran out of "
        f"descriptors below MAX_CONNECTIONS and left it in the backlog (its log: {emfile} lines "
        "of 'accept failed ... retrying')"
    )


# ---- stalled requests -----------------------------------------------------------------------------
def test_a_write_trickled_one_byte_per_timeout_does_not_hold_its_reservation_forever(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The server bounded each recv() by its timeout (SO_RCVTIMEO), not the request: with
    MSG_WAITALL a recv that got some bytes when the timer runs out returns them, and
    recv_into_exact started the next recv with a fresh timer. A writer that sent one byte per
    timeout therefore kept a 1 MiB WRITE going for 2**20 timeouts (a year at the agent's 30 s),
    its reservation fenced: when the reservation timed out the sync only doomed it, and its memory
    stayed used while the connection lived. Now a request must be done by the timeout plus its
    length at MIN_RATE_BPS (1 MiB/s: 1.5 s here). The server's timeout is 0.5 s and the
    reservation's 1 s; after 8 s of a byte every 0.25 s (16 timeouts, 32 B of 1 MiB) the agent
    must have dropped the request and had the reservation's memory back."""
    cluster = start_agent({"timeout_s": 0.5}, reserve_timeout_s=1.0)
    client = make_client(cluster, transports=("tcp",))
    peer = _peer(cluster)
    baseline = _host_used(client)
    dropped_after: float | None = None
    used_while_trickling = baseline
    try:
        (res,) = peer.reserve([(1 * MiB, uuid.uuid4().bytes)], node_id=cluster.agents[0].node_id)
        with connect_raw(cluster) as sock:
            sock.sendall(frames.pack(Op.WRITE, 0, res.alloc_id, res.offset, 1 * MiB))
            started = time.monotonic()
            while time.monotonic() - started < 8.0:
                readable, _, _ = select.select([sock], [], [], 0.25)
                if readable and _closed_by_agent(sock):
                    dropped_after = time.monotonic() - started
                    break
                try:
                    sock.sendall(b"\xee")
                except OSError:
                    dropped_after = time.monotonic() - started
                    break
            if dropped_after is None:
                used_while_trickling = _host_used(client)  # the reservation is long expired
    finally:
        peer.close()
    assert dropped_after is not None and used_while_trickling == baseline, (
        f"a WRITE trickled at 4 B/s ran 8 s (16 of the server's 0.5 s timeouts) without being "
        f"dropped; its reservation, expired after 1 s, still held {used_while_trickling - baseline} B"
    )
    assert _used_becomes(client, baseline)
    _healthy(client, 2)


def test_a_read_whose_reader_trickles_does_not_hold_its_allocation_forever(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The mirror image on the send side: SO_SNDTIMEO bounds each send, so a reader that took a
    little of a READ's reply per timeout kept the READ going, and with it the allocation it reads
    (which a free then only dooms), for as long as it liked. A reply must leave by the timeout
    plus its length at MIN_RATE_BPS: here 0.5 s + 16 MiB at 4 MiB/s, 4.5 s. The reader takes
    128 KiB every 0.2 s (the whole reply would take 25 s) and the allocation is freed meanwhile:
    its memory must be back within 12 s. (The agent's socket buffers are 64 KiB, so that the
    reply cannot go into them whole.)"""
    cluster = start_agent(
        {"timeout_s": 0.5, "MIN_RATE_BPS": 4 * MiB, "SOCKET_BUFFER_BYTES": 64 * KiB}, host_bytes=64 * MiB
    )
    client = make_client(cluster, transports=("tcp",))
    baseline = _host_used(client)
    size = 16 * MiB
    peer = _peer(cluster)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    stop = threading.Event()
    reader: threading.Thread | None = None
    try:
        (res,) = peer.reserve([(size, uuid.uuid4().bytes)], node_id=cluster.agents[0].node_id)
        peer.write(res.alloc_id, res.offset, memoryview(np.ones(size, np.uint8)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * KiB)  # before connect: the window
        sock.settimeout(5)
        sock.connect(agent_address(cluster))
        sock.sendall(frames.pack(Op.READ, 0, res.alloc_id, res.offset, size))
        assert read_reply(sock)[1] == Status.OK
        started = time.monotonic()

        def trickle() -> None:
            sink = bytearray(128 * KiB)
            while not stop.is_set() and time.monotonic() - started < 30:  # bounded either way
                try:
                    if sock.recv_into(sink) == 0:
                        return
                except OSError:
                    return
                stop.wait(0.2)

        reader = threading.Thread(target=trickle, name="trickle", daemon=True)
        reader.start()
        assert peer.free([res.alloc_id]) == 1
        freed = _used_becomes(client, baseline, timeout_s=12.0)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        if reader is not None:
            reader.join(timeout=10)
        sock.close()
        peer.close()
    assert freed, f"a READ trickled out at 640 KiB/s still held its freed allocation after {elapsed:.1f} s"
    _healthy(client, 8)


def test_a_long_train_of_small_reads_on_one_connection_does_not_deadlock(
    start_agent: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """read_many sent every READ header of a train before reading any reply. The agent answers in
    order and stops reading requests while its replies do not fit the socket buffers, so once the
    replies filled the client's receive buffer and the agent's send buffer, and the headers the
    agent's receive buffer and the client's send buffer, both sides blocked in send until the
    client's timeout. With the socket buffers at 64 KiB on both sides (the agent's, and the
    client's, set in this process) a train of 20480 reads of 512 B did so (TransferTimeout after
    5 s); windowed, every read lands in its own destination."""
    monkeypatch.setattr(tcp, "SOCKET_BUFFER_BYTES", 64 * KiB)
    cluster = start_agent({"SOCKET_BUFFER_BYTES": 64 * KiB})
    peer = _peer(cluster)
    piece, rounds = 512, 40
    source = np.random.default_rng(9).integers(0, 256, 256 * KiB, dtype=np.uint8)
    slots = source.nbytes // piece
    out = bytearray(rounds * source.nbytes)
    view = memoryview(out)
    try:
        (res,) = peer.reserve([(source.nbytes, uuid.uuid4().bytes)], node_id=cluster.agents[0].node_id)
        peer.write(res.alloc_id, res.offset, memoryview(source))
        requests = [
            ReadRequest(alloc_id=res.alloc_id, offset=res.offset + i % slots * piece, dest=view[i * piece :][:piece])
            for i in range(rounds * slots)
        ]
        peer.read_many(requests)
        assert out == source.tobytes() * rounds
        assert peer.ping() == frames.VERSION  # the connection is still in step
    finally:
        peer.close()


# ---- malformed frames -----------------------------------------------------------------------------
def test_a_peer_speaking_another_version_or_op_is_told_before_the_close(
    start_agent: Callable[..., LocalCluster],
) -> None:
    """DESIGN.md §3.6 wants bad input answered with an error that names the value and the limit.
    A frame of another protocol version (a client upgraded before the agent) or with an op this
    agent does not know (a newer client's) is answered by a bare close (server.py _serve: unpack's
    ProtocolError; _dispatch: "unknown op", return False), so the peer learns only "peer closed the
    connection after 0 of 32 B". A reply header costs nothing: one in this agent's version with
    BAD_REQUEST (and a = its version) lets frames.unpack on the other side say "frame version 1;
    this build speaks 2", and an old client see the op refused. Likewise a WRITE longer than the
    arena into no reservation: the protocol table (frames.py) promises STALE for a WRITE that no
    live reservation covers, and _write closes without a word when length > the arena (here with
    no payload sent, so nothing would need draining before the reply)."""
    cluster = start_agent()
    cases = {
        "version 2 PING": (
            frames.HEADER.pack(frames.MAGIC, frames.VERSION + 1, Op.PING, 0, 0, 0, 0),
            {Status.BAD_REQUEST},
        ),
        "an unknown op": (frames.pack(max(Op) + 1), {Status.BAD_REQUEST}),
        "WRITE of arena + 1 B into no reservation": (
            frames.pack(Op.WRITE, 0, 12345, 0, cluster.host_bytes + 1),
            {Status.STALE, Status.BAD_REQUEST},
        ),
    }
    silent: list[str] = []
    for name, (frame, statuses) in cases.items():
        with connect_raw(cluster) as sock:
            sock.sendall(frame)
            try:
                raw = sock.recv(frames.HEADER_BYTES)
            except ConnectionResetError:
                raw = b""
            if len(raw) < frames.HEADER_BYTES:
                silent.append(name)
                continue
            magic, version, _op, status, *_ = frames.HEADER.unpack(raw)
            assert (magic, version) == (frames.MAGIC, frames.VERSION) and status in statuses, name
    peer = _peer(cluster)
    try:
        assert peer.ping() == frames.VERSION  # only those connections were closed
    finally:
        peer.close()
    assert not silent, f"the agent closed the connection without a reply to: {silent}"


def test_u64_fields_at_and_past_their_limits_are_refused_cleanly(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Header fields are u64 on the wire and Python ints in the agent: 2**64-1 (a negative number
    to a C peer), offsets whose offset + length pass 2**64, ranges one byte past the arena, and
    RESERVE batches of exactly MAX_BATCH are each refused (STALE, NO_CAPACITY) or served, on the
    same connection, which stays in step; the arena is as it was afterwards."""
    cluster = start_agent(reserve_timeout_s=1.0)
    client = make_client(cluster, transports=("tcp",))
    baseline = _host_used(client)
    arena = cluster.host_bytes
    with connect_raw(cluster) as sock:
        for a, b, c in ((U64_MAX, U64_MAX, U64_MAX), (1, U64_MAX, 2), (1, arena - 1, 2), (1, 0, arena + 1)):
            sock.sendall(frames.pack(Op.READ, 0, a, b, c))
            assert read_reply(sock)[:2] == (Op.READ | frames.REPLY_BIT, Status.STALE), (a, b, c)
        # A WRITE into no reservation, inside the arena: drained, then STALE.
        sock.sendall(frames.pack(Op.WRITE, 0, 12345, 64, 4096) + b"\x01" * 4096)
        assert read_reply(sock)[:2] == (Op.WRITE | frames.REPLY_BIT, Status.STALE)
        entries = b"".join(frames.RESERVE_ENTRY.pack(U64_MAX, b"h" * 16) for _ in range(frames.MAX_BATCH))
        sock.sendall(frames.pack(Op.RESERVE, frames.MAX_BATCH, 0, 0) + entries)
        _, status, _, _, capacity = read_reply(sock)
        assert (status, capacity) == (Status.NO_CAPACITY, arena)
        entries = b"".join(frames.RESERVE_ENTRY.pack(0, b"z%015d" % i) for i in range(frames.MAX_BATCH))
        sock.sendall(frames.pack(Op.RESERVE, frames.MAX_BATCH, 0, 0) + entries)
        assert read_reply(sock)[1] == Status.OK
        ids = [alloc for _, alloc in frames.RESERVE_REPLY.iter_unpack(frames.recv_exact(sock, 16 * frames.MAX_BATCH))]
        assert len(set(ids)) == frames.MAX_BATCH
        sock.sendall(frames.pack(Op.FREE, frames.MAX_BATCH) + frames.pack_ids(ids))
        assert read_reply(sock)[2] == frames.MAX_BATCH
        sock.sendall(frames.pack(Op.PING))
        assert read_reply(sock)[:3] == (Op.PING | frames.REPLY_BIT, Status.OK, frames.VERSION)
    assert _used_becomes(client, baseline)
    _healthy(client, 3)


# ---- torn and concurrent transfers ----------------------------------------------------------------
def test_a_torn_write_a_cut_reserve_and_an_unread_reply_leave_the_arena_as_it_was(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A writer dying mid-payload leaves its reservation with torn bytes: it must never be
    committed or listed, must be reclaimed after its timeout (then READ is STALE), and must not
    disturb the agent. Likewise a RESERVE whose entries are cut short reserves nothing, and one
    whose reply is never read is reclaimed like any abandoned reservation."""
    cluster = start_agent(reserve_timeout_s=1.0)
    client = make_client(cluster, transports=("tcp",))
    threads_before = _agent_threads(cluster)  # no connection served yet
    keep = np.arange(64 * KiB, dtype=np.uint8)
    client.put("keep", keep)
    baseline = _host_used(client)
    peer = _peer(cluster)
    try:
        (res,) = peer.reserve([(1 * MiB, uuid.uuid4().bytes)], node_id=cluster.agents[0].node_id)
        with connect_raw(cluster) as sock:
            sock.sendall(frames.pack(Op.WRITE, 0, res.alloc_id, res.offset, 1 * MiB) + b"\xee" * (300 * KiB))
        with connect_raw(cluster) as sock:  # two entries announced, one sent
            sock.sendall(frames.pack(Op.RESERVE, 2, 0, 0) + frames.RESERVE_ENTRY.pack(4096, b"c" * 16))
        with connect_raw(cluster) as sock:  # granted, never read
            sock.sendall(frames.pack(Op.RESERVE, 1, 0, 0) + frames.RESERVE_ENTRY.pack(2 * MiB, b"u" * 16))
            assert read_reply(sock)[1] == Status.OK
        assert _used_becomes(client, baseline), "abandoned reservations were not reclaimed"
        with pytest.raises(MooncakeError):
            _read(peer, res.alloc_id, res.offset, 16)
    finally:
        peer.close()
    assert bytes(client.get("keep").tobytes()) == keep.tobytes()
    _healthy(client, 4)
    client.close()  # its pooled connections go too: what remains on the agent's side leaked
    assert wait_until(lambda: agent_side_sockets(cluster) == 0, 5)
    assert wait_until(lambda: _agent_threads(cluster) == threads_before, 5)


def test_a_read_under_way_keeps_its_bytes_through_a_concurrent_free(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """DESIGN.md §3.3: a free while a TCP READ is moving the bytes only dooms the allocation. A
    reader that has taken 1 MiB of a 16 MiB READ when the reservation is freed (FREE, then the
    syncs) and a new 16 MiB reservation is written with other bytes must still get the original 16
    MiB; new READs of the freed id are STALE, and the memory comes back once the READ ends."""
    cluster = start_agent(reserve_timeout_s=30.0, host_bytes=64 * MiB)
    client = make_client(cluster, transports=("tcp",))
    baseline = _host_used(client)
    size = 16 * MiB
    original = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    other = np.full(size, 0x5A, np.uint8)
    peer = _peer(cluster)
    node = cluster.agents[0].node_id
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        (res,) = peer.reserve([(size, uuid.uuid4().bytes)], node_id=node)
        peer.write(res.alloc_id, res.offset, memoryview(original))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)  # before connect: a small window
        sock.settimeout(10)
        sock.connect(agent_address(cluster))
        sock.sendall(frames.pack(Op.READ, 0, res.alloc_id, res.offset, size))
        assert read_reply(sock)[1] == Status.OK
        got = bytearray(size)
        view = memoryview(got)
        frames.recv_into_exact(sock, view[: 1 * MiB])
        assert peer.free([res.alloc_id]) == 1
        assert wait_until(lambda: _stale(peer, res.alloc_id, res.offset), 5), "the free never happened"
        (res2,) = peer.reserve([(size, uuid.uuid4().bytes)], node_id=node)
        peer.write(res2.alloc_id, res2.offset, memoryview(other))
        frames.recv_into_exact(sock, view[1 * MiB :])
        assert bytes(got) == original.tobytes(), "a READ under way saw its bytes reused"
        view.release()
        sock.sendall(frames.pack(Op.PING))
        assert read_reply(sock)[1] == Status.OK
        sock.close()
        assert peer.free([res2.alloc_id]) == 1
        assert _used_becomes(client, baseline), "the doomed allocation was not released after its READ"
    finally:
        sock.close()
        peer.close()
    _healthy(client, 5)


def _stale(peer: PeerConnections, alloc_id: int, offset: int) -> bool:
    try:
        _read(peer, alloc_id, offset, 16)
    except MooncakeError:
        return True
    return False


# ---- fences ---------------------------------------------------------------------------------------
def test_fences_are_per_connection_and_end_with_it(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """FENCE fences only live reservations (not committed objects, not unknown ids, not twice on one
    connection); UNFENCE of an id another connection fenced lifts nothing; a FREE of a fenced
    reservation dooms it (READ is STALE) but its memory stays while the fence does, even past the
    reservation timeout and IDLE_CLOSE_S (the documented choice), and the agent's log names the
    connection that holds it past IDLE_CLOSE_S (it holds a slot of the connection limit as long as
    its writer is stuck); the fence holder's UNFENCE then says the copy is void, and the memory
    comes back."""
    cluster = start_agent({"IDLE_CLOSE_S": 1.0}, reserve_timeout_s=1.0)
    client = make_client(cluster, transports=("tcp",))
    client.put("committed", np.ones(4096, np.uint8))
    (meta,) = client.index.lookup(["committed"], lease_ms=0).objects
    assert meta is not None
    committed_id = meta.replicas[0].alloc_id
    assert wait_committed(cluster, committed_id)  # the agent learns of the commit at its next sync
    baseline = _host_used(client)
    peer = _peer(cluster)
    try:
        (res,) = peer.reserve([(64 * KiB, uuid.uuid4().bytes)], node_id=cluster.agents[0].node_id)
        with connect_raw(cluster) as holder, connect_raw(cluster) as other:
            ids = [res.alloc_id, committed_id, res.alloc_id + 777_777, res.alloc_id]
            holder.sendall(frames.pack(Op.FENCE, len(ids)) + frames.pack_ids(ids))
            _, status, digest, count, _ = read_reply(holder)
            assert (status, count) == (Status.OK, len(ids))
            assert digest == segment_digest(cluster.agents[0].shm_name)
            assert list(frames.recv_exact(holder, count)) == [1, 0, 0, 0]
            other.sendall(frames.pack(Op.UNFENCE, 1) + frames.pack_ids([res.alloc_id]))
            assert read_reply(other)[3] == 1 and list(frames.recv_exact(other, 1)) == [0]
            other.sendall(frames.pack(Op.FREE, 1) + frames.pack_ids([res.alloc_id]))
            assert read_reply(other)[2] == 1
            assert wait_until(lambda: _stale(peer, res.alloc_id, res.offset), 5)
            time.sleep(1.5)  # past the reservation timeout and IDLE_CLOSE_S
            assert _host_used(client) > baseline, "a fenced reservation's memory was reused"
            holder_port = holder.getsockname()[1]
            assert wait_until(
                lambda: bool(re.search(rf":{holder_port} holds 1 fence\(s\)", cluster.agents[0].log_tail(20_000))), 3
            ), "the agent kept a stalled fence holder past IDLE_CLOSE_S without a word"
            holder.sendall(frames.pack(Op.UNFENCE, 1) + frames.pack_ids([res.alloc_id]))
            assert read_reply(holder)[3] == 1 and list(frames.recv_exact(holder, 1)) == [0]
        assert _used_becomes(client, baseline)
    finally:
        peer.close()
    _healthy(client, 6)


def test_a_fence_holder_that_dies_gives_its_reservations_back(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A same-host writer that fenced reservations and died (its socket closed by the kernel) must
    not keep them: the close lifts the fences, the abandoned reservations expire, and their memory
    comes back."""
    cluster = start_agent(reserve_timeout_s=1.0)
    client = make_client(cluster, transports=("tcp",))
    baseline = _host_used(client)
    peer = _peer(cluster)
    try:
        reservations = peer.reserve(
            [(256 * KiB, uuid.uuid4().bytes) for _ in range(4)], node_id=cluster.agents[0].node_id
        )
        ids = [r.alloc_id for r in reservations]
        with connect_raw(cluster) as holder:
            holder.sendall(frames.pack(Op.FENCE, len(ids)) + frames.pack_ids(ids))
            assert read_reply(holder)[3] == len(ids) and list(frames.recv_exact(holder, len(ids))) == [1] * 4
            # Dies with an UNFENCE half sent.
            holder.sendall(frames.pack(Op.UNFENCE, len(ids)) + frames.pack_ids(ids)[:12])
        assert _used_becomes(client, baseline), "fences of a closed connection kept their memory"
    finally:
        peer.close()
    _healthy(client, 7)


def test_the_connection_limit_follows_a_hard_descriptor_limit() -> None:
    """Where the hard descriptor limit is below MAX_CONNECTIONS (plus the descriptors an agent keeps
    for itself), the agent serves at most that many connections, so that the next one is turned
    away at once instead of waiting in the backlog for a descriptor (connection_limit). Run in a
    child process: the hard limit cannot be raised again once lowered."""
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))\n"
        "from mooncake_store.agent.server import FD_RESERVE, connection_limit\n"
        "print(connection_limit(), 100 - FD_RESERVE, resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    limit, expected, soft = (int(x) for x in out.stdout.split())
    assert limit == expected and soft == 100


def test_frames_of_unknown_ops_are_logged_once_not_a_line_each(
    make_inproc_agent: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Each connection that sent an op this agent lacks was a WARNING line: any client that reaches
    the port could fill the log (741 lines from one burst). Told once, then with a count every 30 s."""
    agent = make_inproc_agent()
    host, port = agent.server.endpoint.rsplit(":", 1)
    with caplog.at_level(logging.WARNING, logger="mooncake.agent"):
        for _ in range(40):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(frames.pack(max(Op) + 1))
                assert frames.unpack(sock.recv(frames.HEADER_BYTES))[1] == Status.BAD_REQUEST
                assert sock.recv(1) == b""  # closed after the reply
    said = [r for r in caplog.records if "unknown op" in r.getMessage()]
    assert len(said) == 1, f"{len(said)} lines for 40 frames of an unknown op"
