"""Review of the day's wire changes (session 9): the per-request deadline (frames.recv_into_by,
send_all_by, _cut_timer; agent/ops.py MIN_RATE_BPS), BUSY at the connection limit
(agent/refusals.py, the accept loop, PeerConnections._reply and the SDK paths above it) and
read_many's window, driven over real loopback sockets against real agent processes.

Agents run as their own processes through LocalCluster's command line (``python -c``): module
constants of agent/server.py and agent/refusals.py (MAX_CONNECTIONS, ...) and the server's timeout
are set in that process before ``main()`` runs, so that limits are reached at once. Nothing of the
component under test is replaced.

Defects found (each test failed before its fix, which came in the same session):
- test_a_refused_write_whose_payload_takes_over_a_second_is_still_told_busy
- test_a_put_to_an_agent_at_its_connection_limit_raises_connect_error_at_once
- test_a_batch_get_asks_an_agent_that_answered_busy_once_not_once_per_key

The others guard behaviour worth keeping: a flood of refused connections (silent, non-protocol,
half-closed, torn) leaks no socket or descriptor and does not hold up stop(); read_many keeps its
replies in order across windows with STALE replies among them and leaves no connection mid-stream.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
from helpers import wait_until
from patched_agent import agent_port_fds, agent_side_sockets, connect_raw, read_reply

from mooncake_store import Client, LocalCluster
from mooncake_store.errors import ConnectError, MooncakeError, NoCapacity, StaleLocation
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import PeerConnections, ReadRequest

KiB = 1 << 10
MiB = 1 << 20


def _fill(cluster: LocalCluster, count: int) -> list[socket.socket]:
    """``count`` served connections (each answered a PING), held open by the caller."""
    held: list[socket.socket] = []
    for _ in range(count):
        sock = connect_raw(cluster)
        held.append(sock)
        sock.sendall(frames.pack(Op.PING))
        assert read_reply(sock)[1] == Status.OK
    return held


def _peer(cluster: LocalCluster) -> PeerConnections:
    return PeerConnections(cluster.agents[0].endpoint, timeout_s=5, max_idle=2)


# ---- BUSY at the connection limit -----------------------------------------------------------------
def test_a_refused_write_whose_payload_takes_over_a_second_is_still_told_busy(
    start_agent: Callable[..., LocalCluster],
) -> None:
    """README: one connection past the limit gets BUSY (with the limit) in reply to its first
    request, then the close, and the client raises ConnectError naming the agent and the limit;
    refusals.py reads and drops a WRITE's payload so that the close is a FIN behind the reply, not
    a reset the client would see instead. But the drain ends REFUSE_LINGER_S (1 s) after the reply,
    whatever is still coming: _Refusal.step sets ``deadline = now + REFUSE_LINGER_S`` and
    Refusals.expire closes the socket with the rest of the payload unread. The SDK sends a WRITE's
    whole payload before it reads the reply (write_many), so any WRITE that needs more than a
    second to go out (32 MiB at 16 MiB/s here: sixteen times the MIN_RATE_BPS the agent itself
    accepts from a served writer; or a GiB stripe on a fast link) ends in EPIPE or a reset, which
    PeerConnections turns into TransferError("... Broken pipe"), never the BUSY ConnectError."""
    cluster = start_agent({"MAX_CONNECTIONS": 1})
    held = _fill(cluster, 1)
    size, rate = 32 * MiB, 16 * MiB
    sent = 0
    send_error: OSError | None = None
    reply: tuple[int, ...] | None = None
    try:
        with connect_raw(cluster, timeout_s=10.0) as sock:
            sock.sendall(frames.pack(Op.WRITE, 0, 12345, 0, size))
            chunk = bytes(256 * KiB)
            started = time.monotonic()
            try:
                while sent < size:  # 128 chunks, about 2 s
                    sock.sendall(chunk)
                    sent += len(chunk)
                    time.sleep(max(0.0, started + sent / rate - time.monotonic()))
            except OSError as exc:
                send_error = exc
            try:
                reply = read_reply(sock)
            except (OSError, MooncakeError):
                reply = None
    finally:
        for sock in held:
            sock.close()
    assert send_error is None, (
        f"the agent cut off a refused WRITE after {sent >> 20} of {size >> 20} MiB "
        f"({sent / rate:.1f} s at {rate >> 20} MiB/s): the writer got {send_error!r} instead of the "
        f"BUSY reply (which it reads only once its payload is out); read afterwards: {reply}"
    )
    assert reply is not None and reply[:3] == (Op.WRITE | frames.REPLY_BIT, Status.BUSY, 1)


def test_a_put_to_an_agent_at_its_connection_limit_raises_connect_error_at_once(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """README: a client turned away at the limit raises ConnectError naming the agent and the limit
    (the agent is up but full: callers use other replicas and nodes). A put's RESERVE is its first
    request: the ConnectError is caught in Reserver.reserve, _reserve_elsewhere finds no other
    node and raises NoCapacity (not permanent) with the BUSY text inside, and PutPath.run takes that
    for a full cluster whose space leases will free, retrying with backoff until timeout_s. The
    user is told the cluster has no room (NoCapacity, exit code 5) for a 4 KiB object on an agent
    with 16 MiB free, after waiting the whole timeout_s."""
    cluster = start_agent({"MAX_CONNECTIONS": 1})
    timeout_s = 3.0
    client = make_client(cluster, timeout_s=timeout_s)
    held = _fill(cluster, 1)
    try:
        started = time.monotonic()
        with pytest.raises(MooncakeError) as info:
            client.put("busy-put", np.ones(4096, np.uint8))
        elapsed = time.monotonic() - started
    finally:
        for sock in held:
            sock.close()
    error = info.value
    assert "connection limit of 1" in str(error), str(error)
    assert isinstance(error, ConnectError) and not isinstance(error, NoCapacity), (
        f"a put to an agent at its connection limit (16 MiB free) raised {type(error).__name__} after "
        f"{elapsed:.1f} s (timeout_s {timeout_s:g}): {error}"
    )


def test_a_batch_get_asks_an_agent_that_answered_busy_once_not_once_per_key(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """README: a batch that meets an agent that timed out does not ask it again within that call, so
    the batch waits for it once, not once per key and retry. An agent that answers BUSY is treated
    as one the client cannot use (the commit's words), yet nothing in the read path remembers it:
    the train's ConnectError sends every key to _read_object, each of which dials the agent
    (drop_peer after each BUSY, so no pool is reused), and each of max_retries + 1 attempts does
    it again. A get_many of 50 keys on one agent at its limit opens about 200 connections within
    a fraction of a second, each an accept and a refusal on the agent's accept thread (past 16 at
    once, closed without a reply): the client amplifies the overload it was told about. Counted
    here by the refusals' TIME_WAIT sockets on the agent's port (the agent closes first)."""
    cluster = start_agent({"MAX_CONNECTIONS": 1})
    writer = make_client(cluster, transports=("tcp",))
    keys = [f"busy-get-{i}" for i in range(50)]
    writer.put_many({k: np.full(1024, i, np.uint8) for i, k in enumerate(keys)})
    writer.close()
    assert wait_until(lambda: agent_side_sockets(cluster) == 0, 5)
    reader = make_client(cluster, transports=("tcp",))
    held = _fill(cluster, 1)
    try:
        before = agent_side_sockets(cluster, ("06",))
        with pytest.raises(MooncakeError, match="connection limit of 1"):
            reader.get_many(keys)
        time.sleep(0.3)  # the last refusals' closes
        refused = agent_side_sockets(cluster, ("06",)) - before
    finally:
        for sock in held:
            sock.close()
    attempts = reader.config.max_retries + 1
    assert refused <= 2 * attempts, (
        f"a get_many of {len(keys)} keys opened {refused} connections that the agent refused (BUSY), "
        f"about one per key and attempt; at most {attempts} (one per attempt) would do"
    )


def test_a_flood_of_refused_connections_leaks_nothing_and_does_not_hold_up_stop(
    start_agent: Callable[..., LocalCluster],
) -> None:
    """Past the limit, more than MAX_REFUSALS at once: connections that never send, that send
    bytes that are not ours, that send a request and half-close, that send half a header and close,
    and well-formed ones. Those answered are answered BUSY with the limit; once REFUSE_WAIT_S and
    REFUSE_LINGER_S are over the agent holds no socket or descriptor of them, still serves, and a
    SIGTERM while a new batch of refusals is pending stops it promptly and cleanly."""
    cluster = start_agent({"MAX_CONNECTIONS": 2})
    held = _fill(cluster, 2)
    fds_before = agent_port_fds(cluster)
    flood: list[socket.socket] = []
    answered: list[tuple[int, ...]] = []
    try:
        for i in range(40):
            sock = connect_raw(cluster)
            flood.append(sock)
            kind = i % 5
            # Past MAX_REFUSALS the agent closes at once, and may have by now (EPIPE, ECONNRESET,
            # ENOTCONN on a loaded machine): that connection's part of the flood is over.
            with contextlib.suppress(OSError):
                if kind == 1:
                    sock.sendall(b"GET / HTTP/1.1\r\nHost: agent\r\n\r\n")
                elif kind == 2:
                    sock.sendall(frames.pack(Op.READ, 0, 1, 0, 16))
                    sock.shutdown(socket.SHUT_WR)
                elif kind == 3:
                    sock.sendall(frames.pack(Op.PING)[:10])
                    sock.close()
                elif kind == 4:
                    sock.sendall(frames.pack(Op.FREE, 1) + frames.pack_ids([7]))
        for i, sock in enumerate(flood):
            if i % 5 in (2, 4):
                try:
                    raw = sock.recv(frames.HEADER_BYTES, socket.MSG_WAITALL)
                except OSError:
                    raw = b""
                if len(raw) == frames.HEADER_BYTES:
                    answered.append(frames.unpack(raw)[:3])
        assert answered, "no refused connection was told BUSY"
        assert all(a[1:] == (Status.BUSY, 2) for a in answered), answered
        # The agent gives up on the silent ones after REFUSE_WAIT_S (1 s).
        assert wait_until(lambda: agent_side_sockets(cluster) == 2, 6), "refused sockets were kept"
        assert wait_until(lambda: agent_port_fds(cluster) == fds_before, 6), "refused descriptors were kept"
    finally:
        for sock in flood:
            sock.close()
        for sock in held:
            sock.close()

    def slots_free() -> bool:  # the agent has seen its served connections close (none in CLOSE_WAIT)
        return agent_side_sockets(cluster) == 0

    assert wait_until(slots_free, 6), "the agent kept connections its clients closed"
    peer = _peer(cluster)
    try:
        assert peer.ping() == frames.VERSION
    finally:
        peer.close()
    assert wait_until(slots_free, 6)
    # stop() while refusals are pending: the agent exits at once, cleanly.
    filler = _fill(cluster, 2)
    pending = [connect_raw(cluster) for _ in range(10)]
    try:
        time.sleep(0.2)
        process = cluster.agents[0].process
        process.send_signal(signal.SIGTERM)
        rc = process.wait(timeout=8)
    finally:
        for sock in pending + filler:
            sock.close()
    assert rc == 0


# ---- read_many's window ---------------------------------------------------------------------------
def test_read_many_keeps_order_across_windows_with_stale_replies_among_them(
    start_agent: Callable[..., LocalCluster],
) -> None:
    """A train of 300 reads with a window of 8 (windows refilled mid-train) in which every 37th
    names an allocation the agent does not hold: STALE replies carry no payload, so every other
    read must land in its own destination with its own bytes, the call must end StaleLocation, and
    the connection must not go back to the pool mid-stream (the next call on the pool is in step)."""
    cluster = start_agent()
    peer = _peer(cluster)
    piece = 1000  # not a power of two: a misplaced reply shows
    source = np.random.default_rng(3).integers(0, 256, 256 * piece, dtype=np.uint8)
    try:
        (res,) = peer.reserve([(source.nbytes, uuid.uuid4().bytes)], node_id=cluster.agents[0].node_id)
        peer.write(res.alloc_id, res.offset, memoryview(source))
        count = 300
        out = bytearray(b"\xaa" * (count * piece))
        view = memoryview(out)
        stale = {i for i in range(count) if i % 37 == 5}
        requests = [
            ReadRequest(
                alloc_id=res.alloc_id + 999_999 if i in stale else res.alloc_id,
                offset=res.offset + (i * 7 % 256) * piece,
                dest=view[i * piece :][:piece],
            )
            for i in range(count)
        ]
        with pytest.raises(StaleLocation):
            peer.read_many(requests, window=8)
        for i in range(count):
            got = bytes(out[i * piece : (i + 1) * piece])
            if i in stale:
                assert got == b"\xaa" * piece, f"read {i} (STALE) was written to"
            else:
                start = (i * 7 % 256) * piece
                assert got == source[start : start + piece].tobytes(), f"read {i} got another read's bytes"
        view.release()
        assert peer.ping() == frames.VERSION
        again = bytearray(piece)
        peer.read_many([ReadRequest(alloc_id=res.alloc_id, offset=res.offset, dest=memoryview(again))])
        assert bytes(again) == source[:piece].tobytes()
    finally:
        peer.close()
