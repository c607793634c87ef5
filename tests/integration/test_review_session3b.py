"""Review of blocking sockets with kernel timeouts (f92b7bc), pipelined WRITEs (05bf365) and the
agent server's idle poll: no thread may hang forever, a timeout is a clear TransferError, and no
pooled connection is reused mid-frame.

Real agents (in this process, or LocalCluster subprocesses) against the session's real Valkey;
where a peer must misbehave in a way no agent does (stall halfway through a reply), a plain
socket plays the agent. Every wait is bounded; processes are stopped by their own PID only.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import stop_process, wait_until

from mooncake_store.agent.server import AgentServer
from mooncake_store.config import load_config
from mooncake_store.errors import MooncakeError, StaleLocation, TransferError
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import PeerConnections, ReadRequest, parse_endpoint

KiB = 1 << 10
MiB = 1 << 20


def _in_thread(func: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """(finished, result or the exception it raised): run ``func`` on a daemon thread, so that a
    call that would hang fails the test instead of hanging the suite."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(func())
        except BaseException as exc:  # handed back to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return (not thread.is_alive()), (out[0] if out else None)


def _silent_listener() -> socket.socket:
    """A port that accepts connections (the kernel's backlog does) and never says a word."""
    return socket.create_server(("127.0.0.1", 0))


# ---- kernel timeouts -------------------------------------------------------------------------


def test_timeval_layout_round_trips_on_this_platform() -> None:
    """SO_RCVTIMEO / SO_SNDTIMEO take a struct timeval; "ll" must be what the kernel reads back."""
    with socket.socket() as sock:
        frames.kernel_timeouts(sock, 1.25)
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            raw = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("ll"))
            sec, usec = struct.unpack("ll", raw)
            assert sec == 1 and 250_000 <= usec < 260_000  # the kernel rounds up to its tick
        assert sock.gettimeout() is None  # blocking: MSG_WAITALL applies


def test_a_sub_microsecond_timeout_is_still_a_timeout_not_a_hang() -> None:
    """client.timeout_s is valid for any value above 0 (the config says so). kernel_timeouts turns
    5e-7 s into timeval {0, 0}, which the kernel reads as "no timeout at all": the client then
    waits forever on an agent that does not answer, where settimeout(5e-7) used to time out."""
    assert load_config(overrides={"client.timeout_s": 5e-7}).client.timeout_s == 5e-7
    listener = _silent_listener()
    peer = PeerConnections(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=5e-7, max_idle=1)
    try:
        finished, result = _in_thread(peer.ping, timeout_s=3.0)
        assert finished, "ping() on a silent agent with timeout_s=5e-7 still blocks after 3 s"
        assert isinstance(result, MooncakeError), result
    finally:
        peer.close()  # closes nothing in use; the hung thread (if any) is a daemon
        listener.close()


def test_a_trickling_reply_is_progress_and_a_stalled_one_a_clear_timeout() -> None:
    """MSG_WAITALL with SO_RCVTIMEO returns what arrived when the timeout runs out: a reply that
    keeps trickling in (each gap under timeout_s, the whole longer, and within the reply's own
    deadline, timeout_s + its length at MIN_RATE_BPS: 2 s for 1 MiB here) must still land
    whole; one that stops halfway is a TransferError that says so, and its connection is not
    pooled again. (One slower than its deadline is cut: test_sdk_cut_short.py.)"""
    # Margins of half a second or more either way (gaps 0.25 s against 1 s, the whole 1.5 s
    # against 2 s, the stall 3 s against 1 s): a helper thread on a loaded machine runs late.
    timeout_s = 1.0
    n = 1024 * KiB
    payload = bytes(range(256)) * (n // 256)
    listener = socket.create_server(("127.0.0.1", 0))
    served: list[str] = []

    def agent() -> None:
        listener.settimeout(10)
        # First connection: the payload in seven pieces 0.25 s apart (1.5 s in all).
        conn, _ = listener.accept()
        with conn:
            frames.recv_exact(conn, frames.HEADER_BYTES)
            conn.sendall(frames.pack(Op.READ | frames.REPLY_BIT, Status.OK, 0, 0, n))
            for i in range(7):
                conn.sendall(payload[i * n // 7 : (i + 1) * n // 7])
                time.sleep(0.25)
            served.append("trickle")
            # Second request on the same (pooled) connection: half the payload, then silence.
            frames.recv_exact(conn, frames.HEADER_BYTES)
            conn.sendall(frames.pack(Op.READ | frames.REPLY_BIT, Status.OK, 0, 0, n))
            conn.sendall(payload[: n // 2])
            time.sleep(3.0)
            served.append("stall")

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    peer = PeerConnections(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=timeout_s, max_idle=1)
    try:
        got = bytearray(n)
        finished, result = _in_thread(
            lambda: peer.read_many([ReadRequest(alloc_id=1, offset=0, dest=memoryview(got))]), timeout_s=5
        )
        assert finished and result is None, result
        assert bytes(got) == payload
        assert len(peer._idle) == 1  # in step: pooled again
        started = time.monotonic()
        finished, result = _in_thread(
            lambda: peer.read_many([ReadRequest(alloc_id=1, offset=0, dest=memoryview(bytearray(n)))]), timeout_s=5
        )
        assert finished
        assert isinstance(result, TransferError) and "made no progress for 1 s" in str(result), result
        assert time.monotonic() - started < 3
        assert peer._idle == []  # mid-frame: dropped, never handed to the next call
    finally:
        peer.close()
        thread.join(5)
        listener.close()


# ---- the agent's server: idle poll, stop(), clients that die --------------------------------


def test_stop_wakes_every_connection_thread_idle_or_mid_request(make_inproc_agent) -> None:  # type: ignore[no-untyped-def]
    """Idle connections wait in poll() with no timeout: stop() must still end their threads (it
    shuts the connections down), and a thread in the middle of a request (half a header sent) too."""
    agent = make_inproc_agent()
    server = AgentServer("127.0.0.1:0", agent.arena, agent.table, timeout_s=30.0, hooks=agent)
    server.start()
    socks = [socket.create_connection(parse_endpoint(server.endpoint), timeout=5) for _ in range(3)]
    try:
        for sock in socks:
            sock.sendall(frames.pack(Op.PING))
            assert frames.unpack(frames.recv_exact(sock, frames.HEADER_BYTES))[1] == Status.OK
        socks[2].sendall(frames.pack(Op.PING)[:10])  # a request under way, stuck in recv
        assert wait_until(lambda: len(server._threads) == 3, 3)
        threads = list(server._threads)
        started = time.monotonic()
        server.stop()
        assert all(not t.is_alive() for t in threads), "a connection thread outlived stop()"
        assert time.monotonic() - started < 3
        for sock in socks:
            # Closed: a FIN, or a reset where the server closed with the half header unread (stop()
            # may come before that connection's thread reaches its recv).
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                assert sock is socks[2]
    finally:
        for sock in socks:
            sock.close()
        server.stop()


_HALF_WRITER = """
import socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
sock.sendall(bytes.fromhex(sys.argv[3]) + b"x" * 1000)
print("sent", flush=True)
time.sleep(60)
"""


def test_a_client_killed_mid_write_frees_its_fence_at_once(make_inproc_agent) -> None:  # type: ignore[no-untyped-def]
    """A writer process killed halfway through a WRITE: the agent's blocking MSG_WAITALL recv must
    see the connection close (not wait its 30 s timeout), lift the reservation's write fence, and
    the reservation then takes a whole write."""
    agent = make_inproc_agent()
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    (res,) = peer.reserve([(1 * MiB, b"k" * 16)], node_id=agent.node_id)
    host, port = parse_endpoint(agent.server.endpoint)
    header = frames.pack(Op.WRITE, 0, res.alloc_id, res.offset, 1 * MiB).hex()
    writer = subprocess.Popen([sys.executable, "-c", _HALF_WRITER, host, str(port), header], stdout=subprocess.PIPE)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == b"sent"
        # The agent has begun the dead writer's WRITE (its fence is on) before the kill: else the
        # second write could land first and the dead writer's buffered bytes after it.
        assert wait_until(lambda: agent.table._allocs[res.alloc_id].readers >= 1, 3)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=5)
        payload = np.full(1 * MiB, 9, np.uint8)
        started = time.monotonic()
        landed = False
        while not landed and time.monotonic() - started < 5:  # bounded: 5 s, the agent's timeout is 30
            try:
                peer.write(res.alloc_id, res.offset, memoryview(payload))
                landed = True
            except StaleLocation:  # still fenced by the dead writer's WRITE
                time.sleep(0.05)
        assert landed, "the dead writer's fence was not lifted within 5 s"
        got = bytearray(1 * MiB)
        peer.read_many([ReadRequest(alloc_id=res.alloc_id, offset=res.offset, dest=memoryview(got))])
        assert bytes(got) == payload.tobytes()
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(timeout=5)
        if writer.stdout is not None:
            writer.stdout.close()
        peer.close()


# ---- pipelined writes: acks and the pool ----------------------------------------------------


def test_write_many_on_a_connection_the_agent_drops_is_an_error_and_not_pooled(make_inproc_agent) -> None:  # type: ignore[no-untyped-def]
    """A WRITE the agent will not even drain (longer than its arena) closes the connection with
    acks still owed: write_many must raise TransferError and the socket must not go back to the
    pool; the next call works on a fresh connection."""
    agent = make_inproc_agent(host_bytes=4 * MiB)
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    try:
        (res,) = peer.reserve([(4 * KiB, b"w" * 16)], node_id=agent.node_id)
        good = np.full(4 * KiB, 3, np.uint8)
        too_long = np.zeros(5 * MiB, np.uint8)
        requests = [
            (res.alloc_id, res.offset, memoryview(good)),
            (res.alloc_id + 777_777, 0, memoryview(too_long)),
            (res.alloc_id, res.offset, memoryview(good)),
        ]
        finished, result = _in_thread(lambda: peer.write_many(requests, window=4), timeout_s=10)
        assert finished, "write_many hung on a connection the agent closed"
        assert isinstance(result, TransferError), result
        assert peer._idle == []
        assert peer.ping() == frames.VERSION
        got = bytearray(4 * KiB)
        peer.read_many([ReadRequest(alloc_id=res.alloc_id, offset=res.offset, dest=memoryview(got))])
        assert bytes(got) == good.tobytes()
    finally:
        peer.close()


def test_a_frozen_agent_is_a_bounded_error_and_its_late_reply_never_reaches_a_later_get(
    make_cluster, make_client
) -> None:  # type: ignore[no-untyped-def]
    """An agent process stopped (SIGSTOP) while a TCP get waits for it: the get ends with a
    TransferError after about timeout_s per try, not never. Once it runs again, it sends its late
    reply into the connection the client dropped; the next get must read the right bytes, not that
    reply (a pooled connection reused mid-frame would)."""
    cluster = make_cluster(1)
    client = make_client(cluster, transports=("tcp",), timeout_s=0.5, max_retries=0)
    a = np.arange(256 * KiB, dtype=np.uint8)
    b = np.full(256 * KiB, 7, np.uint8)
    client.put("a", a)
    client.put("b", b)
    assert np.array_equal(client.get("a"), a)  # a pooled connection exists now
    pid = cluster.agents[0].pid
    try:
        # Every thread of it stopped (state T), not merely the signal sent: on a loaded machine a
        # thread still running would answer the get below before it stops.
        stop_process(pid)
        started = time.monotonic()
        finished, result = _in_thread(lambda: client.get("a"), timeout_s=10)
        assert finished, "get() on a frozen agent still blocks after 10 s"
        assert isinstance(result, TransferError), result
        assert time.monotonic() - started < 5
    finally:
        os.kill(pid, signal.SIGCONT)

    def read_after_resume(key: str) -> np.ndarray:
        """Through the same client (its pool is what is tested): the agent, catching up on its
        loops, may miss the 0.5 s timeout on a loaded machine, which is tried again; wrong bytes
        (the late reply) are the failure."""
        for _ in range(10):
            try:
                return client.get(key)
            except TransferError:
                continue
        raise AssertionError(f"no read of {key!r} within 10 tries of 0.5 s")

    for _ in range(3):
        assert np.array_equal(read_after_resume("b"), b)
        assert np.array_equal(read_after_resume("a"), a)


@pytest.mark.parametrize("timeout_s", [0.3, 2.5])
def test_kernel_timeouts_match_the_python_timeout_they_replace(timeout_s: float) -> None:
    """A silent agent: ping() raises after about timeout_s, both below and above one second
    (tv_sec and tv_usec both set)."""
    listener = _silent_listener()
    peer = PeerConnections(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=timeout_s, max_idle=1)
    try:
        started = time.monotonic()
        finished, result = _in_thread(peer.ping, timeout_s=timeout_s + 3)
        elapsed = time.monotonic() - started
        assert finished and isinstance(result, TransferError), result
        assert timeout_s * 0.8 <= elapsed < timeout_s + 2
    finally:
        peer.close()
        listener.close()
