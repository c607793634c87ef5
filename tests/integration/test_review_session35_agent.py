"""An exception other than OSError in the agent's accept loop (a bug in admitting or turning away a
connection) ended its accept thread while heartbeats went on: the node looked alive and served no
one, its objects unreadable and never repaired. The loop now closes the one connection and goes on.
The bug is injected by wrapping the step, as no input is known to raise there."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

from mooncake_store.agent.node import Agent
from mooncake_store.agent.refusals import Refusals
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import parse_endpoint


def _pings(agent: Agent, timeout_s: float = 3.0) -> bool:
    """Whether the agent answers a PING on a new connection within ``timeout_s``."""
    with socket.create_connection(parse_endpoint(agent.server.endpoint), timeout=timeout_s) as sock:
        reply = bytearray()
        try:
            sock.sendall(frames.pack(Op.PING))
            while len(reply) < frames.HEADER_BYTES:
                chunk = sock.recv(frames.HEADER_BYTES - len(reply))
                if not chunk:
                    return False
                reply += chunk
        except (TimeoutError, ConnectionResetError):  # closed on us, or never served
            return False
    _, _, op, status, _, _, _ = frames.HEADER.unpack(reply)
    return op == Op.PING | frames.REPLY_BIT and status == Status.OK


def _failing_once(real: Callable[..., Any], failed: list[bool]) -> Callable[..., Any]:
    def step(*args: Any) -> Any:
        if not failed:
            failed.append(True)
            raise RuntimeError("a bug in the step (injected)")
        return real(*args)

    return step


def test_a_bug_admitting_one_connection_leaves_the_agent_serving(make_inproc_agent: Callable[..., Agent]) -> None:
    agent = make_inproc_agent()
    failed: list[bool] = []
    agent.server._admit = _failing_once(agent.server._admit, failed)  # type: ignore[method-assign]
    assert not _pings(agent, timeout_s=1.0)  # that connection is closed
    assert failed
    assert _pings(agent)  # the next one is served: the accept thread lives
    assert agent.server._accept_thread.is_alive()


def test_a_bug_turning_one_connection_away_leaves_the_agent_serving(
    make_inproc_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = make_inproc_agent()
    failed: list[bool] = []
    monkeypatch.setattr(Refusals, "step", _failing_once(Refusals.step, failed))
    agent.server.max_connections = 1
    with socket.create_connection(parse_endpoint(agent.server.endpoint), timeout=3) as held:
        held.sendall(frames.pack(Op.PING))
        assert len(held.recv(frames.HEADER_BYTES)) > 0  # served: the one connection the limit allows
        assert not _pings(agent, timeout_s=1.0)  # past the limit: turned away, and its step fails
        assert failed
    agent.server.max_connections = 64
    assert _pings(agent)  # served: the accept thread lives
    assert agent.server._accept_thread.is_alive()
