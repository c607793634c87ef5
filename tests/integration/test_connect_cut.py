"""A connect under way is cut like a transfer under way. A client's close() and a Cancel shut down
the connections of calls in flight, but a connection still being opened was not one of them: a
call connecting to an agent whose host went dark (SYNs unanswered, as a loopback listener whose
queue is full makes them) waited out the whole timeout_s after its client was closed."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import DarkPeer, node_row, pending_put

from mooncake_store import MooncakeError, connect
from mooncake_store.errors import ConnectError
from mooncake_store.index.client import RedisIndex
from mooncake_store.transport.cancel import Cancel, running_under
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import TierKind, TierUsage

TIMEOUT_S = 20.0  # what a cut connect would otherwise wait
CUT_WITHIN_S = 2.0


@pytest.fixture
def dark() -> Iterator[DarkPeer]:
    peer = DarkPeer()
    yield peer
    peer.close()


def run_cut(call: Callable[[], object], cut: Callable[[], None]) -> tuple[BaseException | None, float]:
    """``call`` in a thread, cut by ``cut`` once it has waited a while: (what it raised, seconds
    from the cut to its end)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # reported to the test
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive(), f"the call ended before the cut: {raised}"
    started = time.monotonic()
    cut()
    thread.join(TIMEOUT_S + 10)
    return (raised[0] if raised else None), time.monotonic() - started


def test_the_dark_peer_holds_a_connect_until_its_timeout(dark: DarkPeer) -> None:
    """The fixture does what the tests rely on: a connect neither completes nor fails."""
    transport = TcpTransport(timeout_s=1.0, connections_per_peer=1, stripe_bytes=1 << 20)
    try:
        started = time.monotonic()
        with pytest.raises(ConnectError, match="timed out"):
            transport.peer(dark.endpoint).ping()
        assert time.monotonic() - started >= 0.9
    finally:
        transport.close()


def test_closing_the_transport_cuts_a_connect_under_way(dark: DarkPeer) -> None:
    transport = TcpTransport(timeout_s=TIMEOUT_S, connections_per_peer=1, stripe_bytes=1 << 20)
    raised, took = run_cut(lambda: transport.peer(dark.endpoint).ping(), transport.close)
    assert isinstance(raised, MooncakeError) and not isinstance(raised, ConnectError), raised
    assert "closed" in str(raised)
    assert took < CUT_WITHIN_S, f"the connect ended {took:.1f} s after the transport closed"


def test_a_cancel_cuts_a_connect_under_way(dark: DarkPeer) -> None:
    transport = TcpTransport(timeout_s=TIMEOUT_S, connections_per_peer=1, stripe_bytes=1 << 20)
    cancel = Cancel("the prefix cache is closed")

    def ping() -> None:
        with running_under(cancel):
            transport.peer(dark.endpoint).ping()

    try:
        raised, took = run_cut(ping, cancel.cancel)
    finally:
        transport.close()
    assert isinstance(raised, MooncakeError) and str(raised) == "the prefix cache is closed", raised
    assert took < CUT_WITHIN_S, f"the connect ended {took:.1f} s after the cancel"


def test_closing_a_client_cuts_a_get_connecting_to_a_dark_node(redis_url: str, dark: DarkPeer) -> None:
    """The object's one replica is on a node whose endpoint is dark: the get connects, and the
    client's close() must end it at once, as it ends one waiting on a stalled agent."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    index = RedisIndex(redis_url, namespace=namespace, timeout_s=10.0)
    try:
        row = node_row("dark", tiers=(TierUsage(tier=TierKind.HOST, capacity_bytes=1 << 30, used_bytes=0),))
        index.register_node(dataclasses.replace(row, tcp_endpoint=dark.endpoint), incarnation="d1", ttl_ms=60_000)
        put = pending_put("far", ("dark", TierKind.HOST, 1), size=16)
        index.put_start([put], ttl_ms=60_000)
        assert index.put_commit([put.put_id]) == ["OK"]
    finally:
        index.close()
    client = connect(redis_url, namespace=namespace, timeout_s=TIMEOUT_S, transports=("tcp",))
    out = np.zeros(16, np.uint8)
    raised, took = run_cut(lambda: client.get_into("far", out), client.close)
    assert isinstance(raised, MooncakeError) and "closed" in str(raised), raised
    assert took < CUT_WITHIN_S, f"the get ended {took:.1f} s after its client closed"
