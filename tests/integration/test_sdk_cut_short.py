"""Calls of the SDK cut short or held by others: a second close() of a PrefixCache, an agent that
trickles its replies, an agent at its connection limit."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import assert_a_second_close_waits_for_the_first
from patched_agent import connect_raw, read_reply

from mooncake_store import Client, LocalCluster, PrefixCache
from mooncake_store.errors import AgentBusy, TransferTimeout
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import PeerConnections, ReadRequest

MiB = 1 << 20


def test_a_second_prefix_cache_close_returns_only_once_the_first_has_closed(
    shared_cluster: LocalCluster, shared_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PrefixCache.close() promises that its loads and stores have ended when it returns; a
    second close() from another thread returned at once while the first still waited for a store
    in flight. The first is held in that wait (a wrapper around the client's drain)."""
    cache = PrefixCache(shared_client, "s22-close/u8/L1/kv1/d8/tp0", chunk_tokens=4)
    assert_a_second_close_waits_for_the_first(cache.close, shared_client._in_flight, monkeypatch)


def _trickling_agent(
    at_once: bytes, trickled: bytes, stop: threading.Event, sent: list[int] | None = None
) -> tuple[socket.socket, threading.Thread]:
    """A peer on loopback that reads one request header, sends ``at_once``, then ``trickled`` one
    byte every 0.2 s (an agent stalled under load, or a broken one): never a whole timeout apart.
    ``sent`` gets one entry per trickled byte sent."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            frames.recv_exact(conn, frames.HEADER_BYTES)
            try:
                conn.sendall(at_once)
                for byte in trickled:
                    if stop.wait(0.2):
                        return
                    conn.sendall(bytes([byte]))
                    if sent is not None:
                        sent.append(byte)
            except OSError:
                return  # the client gave up and closed: what is wanted

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize("trickled", ["reply header", "READ payload"])
def test_an_agent_trickling_its_reply_is_cut_off_by_the_request_deadline(trickled: str) -> None:
    """SO_RCVTIMEO bounds each recv only: a recv that got a byte before its timer ran out returns
    it, and the client's recv_into_exact started the next recv with a fresh timer. An agent that
    sent a byte every 0.2 s (timeout_s 0.5 s) therefore held a READ of 64 B for about 13 s, a
    reply header of 32 B for about 6 s. Now a reply must be in within timeout_s plus its length at
    MIN_RATE_BPS, as the agent already asks of its requests: about 0.5 s here."""
    payload = bytes(range(64))
    header = frames.pack(Op.READ | frames.REPLY_BIT, Status.OK, 0, 0, len(payload))
    stop = threading.Event()
    sent: list[int] = []
    trickle = payload if trickled == "READ payload" else header + payload
    listener, thread = _trickling_agent(header if trickled == "READ payload" else b"", trickle, stop, sent)
    host, port = listener.getsockname()
    peer = PeerConnections(f"{host}:{port}", timeout_s=0.5, max_idle=2)
    dest = bytearray(len(payload))
    try:
        # Cut by the reply's deadline; on a loaded machine the trickle may stall a whole timeout
        # first, and the read is cut for making no progress: either way, cut.
        with pytest.raises(
            TransferTimeout,
            match=r"agent at 127\.0\.0\.1:\d+(: reply not done by its deadline: .*; "
            r"\d\.\d\d s allowed \(timeout_s 0\.5 s, and \d+ B at 1 MiB/s\)| made no progress for 0\.5 s)",
        ):
            peer.read_many([ReadRequest(alloc_id=1, offset=0, dest=memoryview(dest))])
        cut_after = len(sent)
    finally:
        stop.set()
        peer.close()
        thread.join(10)
        listener.close()
    # Cut long before the peer was done: the whole trickle takes 0.2 s a byte.
    assert cut_after < len(trickle) // 2, f"the read waited for {cut_after} of {len(trickle)} trickled bytes"


@contextlib.contextmanager
def _one_place_held(cluster: LocalCluster) -> Iterator[None]:
    """A raw connection the agent served (it counts against the limit), once the agent has seen
    the close of connections the client just closed (until then they count, and it gets BUSY)."""
    for _ in range(100):
        sock = connect_raw(cluster)
        sock.sendall(frames.pack(Op.PING))
        if read_reply(sock)[1] == Status.OK:
            break
        sock.close()
        time.sleep(0.05)
    else:
        raise AssertionError("the agent kept turning a second connection away for 5 s")
    with sock:
        yield


def test_an_agent_at_its_connection_limit_keeps_the_clients_pooled_connections(
    start_agent: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A read one of whose stripes the agent turned away at its connection limit (BUSY) dropped the
    client's whole pool for that agent: every other thread's connection to it was closed when its
    call came back instead of pooled, so they all reconnected to an agent already at its limit,
    each another accept and possibly another refusal. The agent is up and its connections are
    healthy: the pool stays. Here the limit is 2, a raw connection holds one place, and a read of
    two stripes finds the client's one pooled connection plus a second turned away."""
    cluster = start_agent({"MAX_CONNECTIONS": 2}, host_bytes=32 * MiB)
    client = make_client(cluster, transports=("tcp",), tcp_connections=2, stripe_bytes=1 * MiB)
    value = np.arange(4 * MiB, dtype=np.uint8)
    client.put("s22-busy", value)
    endpoint = cluster.agents[0].endpoint
    pool = client._tcp.peer(endpoint)
    with pool._lock:
        for sock, _ in pool._idle[1:]:  # exactly one pooled connection: the read needs a second
            sock.close()
        del pool._idle[1:]
    # Each stripe goes on only once both hold a connection: on a loaded machine the second one
    # could otherwise take its connection when the first was done, the same (pooled) one, and
    # was never turned away. (Started together was not enough: the first read 2 MiB before the
    # second thread woke from the barrier.)
    real_acquire = pool._acquire
    stripes = threading.Barrier(2, timeout=10)

    def connection_each_at_once() -> socket.socket:
        sock = real_acquire()
        stripes.wait()
        return sock

    pool._acquire = connection_each_at_once  # type: ignore[method-assign]
    with _one_place_held(cluster):
        try:
            with pytest.raises(AgentBusy, match=r"connection limit of 2\b"):
                client.get("s22-busy")
        finally:
            del pool._acquire  # the class's again
        assert client._tcp.peer(endpoint) is pool, "the pool was dropped on a BUSY refusal"
        assert len(pool._idle) == 1, "the healthy connection of the read was closed, not pooled"
    # The agent counts the held connection until it has seen its close: read again until it has.
    deadline = time.monotonic() + 10
    while True:
        try:
            got = client.get("s22-busy")
            break
        except AgentBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert np.array_equal(got, value)
