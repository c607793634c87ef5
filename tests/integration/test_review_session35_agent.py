"""Bugs in one step of an agent's loops no longer take the loop with them (each is injected by
wrapping the step, as no input is known to raise there):
- an exception other than OSError in the accept loop (admitting or turning away a connection)
  ended its accept thread while heartbeats went on: the node looked alive and served no one, its
  objects unreadable and never repaired. The loop now closes that one connection and goes on;
- a spill batch's swap that raised something other than a MooncakeError ended the spill before
  the swaps of the batches after it were collected: their moves went uncounted (spills out). It
  is now a swap whose outcome is unknown, as an index error is, and the others are counted."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import put_on, replicas_of

from mooncake_store.agent.node import Agent
from mooncake_store.agent.refusals import Refusals
from mooncake_store.agent.spill import Spiller, SpillJob
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import parse_endpoint
from mooncake_store.types import TierKind

SIZE = 256 << 10


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
    def step(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(True)
            raise RuntimeError("a bug in the step (injected)")
        return real(*args, **kwargs)

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


def test_a_bug_in_one_spill_swap_leaves_the_others_counted(make_peer_agent: Callable[..., Agent]) -> None:
    a = make_peer_agent(host_bytes=4 << 20)
    b = make_peer_agent(host_bytes=8 << 20)
    values = {f"o{i}": np.full(SIZE, i + 1, np.uint8) for i in range(6)}
    for key, value in values.items():
        put_on(a, key, value, tier=TierKind.HOST)
    victims = sorted(a.index.victim_candidates(a.node_id, "host"), key=lambda c: c.key)
    jobs = [SpillJob(victim=v, offset=a.table.offset_of(v.alloc_id)[0]) for v in victims]  # type: ignore[index]
    failed: list[bool] = []
    a.index.move_replicas = _failing_once(a.index.move_replicas, failed)  # type: ignore[method-assign]
    spiller = Spiller(a, streams=1, batch_bytes=2 * SIZE)  # three batches; the first one's swap fails
    try:
        result = spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    assert failed
    assert result.error is not None and "a bug in the step (injected)" in str(result.error)
    assert sorted(j.victim.key for j in result.moved) == ["o2", "o3", "o4", "o5"]
    assert sorted(job.victim.key for job, _ in result.unknown) == ["o0", "o1"]  # the caller asks the index
    for key, value in values.items():
        (replica,) = replicas_of(a, key)
        owner = b if key in ("o2", "o3", "o4", "o5") else a
        assert replica.node_id == owner.node_id, key
        assert bytes(owner.arena.view(replica.offset, SIZE)) == value.tobytes(), key
