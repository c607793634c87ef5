"""Fixtures of the review tests: in-process agents that reach the index through a RedisProxy
(tests/redis_proxy.py), whose passes and syncs run only when a test calls them; and agent
processes with some of their constants set (tests/patched_agent.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from helpers import SilentPeer
from patched_agent import PatchedCluster
from redis_proxy import QUIET, RedisProxy, idle_pressure

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.agent.node import Agent
from mooncake_store.config import AgentConfig


@pytest.fixture
def proxy(redis_url: str) -> Iterator[RedisProxy]:
    px = RedisProxy(redis_url)
    try:
        yield px
    finally:
        px.close()


@pytest.fixture
def proxied_agent(redis_url: str, proxy: RedisProxy) -> Iterator[Callable[..., Agent]]:
    """In-process Agents whose index connections go through ``proxy``; stopped at the end (with the
    proxy up again, so that they deregister)."""
    made: list[Agent] = []

    def make(namespace: str, **overrides: Any) -> Agent:
        settings = {**QUIET, "node_id": f"px-{uuid.uuid4().hex[:6]}", **overrides}
        agent = Agent(AgentConfig(**settings), redis_url=proxy.url, namespace=namespace)
        idle_pressure(agent)
        made.append(agent)
        agent.start()
        direct = redis.Redis.from_url(redis_url)
        try:  # a NOSCRIPT round trip must not absorb an injected fault
            for script in agent.index._scripts.values():
                direct.script_load(script.script)
        finally:
            direct.close()
        return agent

    yield make
    proxy.up()
    for agent in made:
        agent.stop()


@pytest.fixture
def direct_agent(make_inproc_agent: Callable[..., Agent]) -> Callable[..., Agent]:
    """In-process Agents on the real server (no proxy), quiet like the proxied ones."""

    def make(namespace: str, **overrides: Any) -> Agent:
        settings = {**QUIET, "node_id": f"dx-{uuid.uuid4().hex[:6]}", **overrides}
        return make_inproc_agent(namespace=namespace, prepare=idle_pressure, **settings)

    return make


@pytest.fixture
def client_of(redis_url: str) -> Iterator[Callable[[str], Client]]:
    """Clients straight to the real server (never through the proxy), closed at the end."""
    made: list[Client] = []

    def make(namespace: str) -> Client:
        c = connect(redis_url, namespace=namespace, timeout_s=20.0)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def start_agent(redis_url: str) -> Iterator[Callable[..., LocalCluster]]:
    """``start_agent(patch, reserve_timeout_s=..., host_bytes=...)``: one agent process (PatchedCluster)
    in a namespace of its own; every one started is stopped (by PID, segment removed) at the end."""
    started: list[LocalCluster] = []

    def start(
        patch: dict[str, Any] | None = None, *, reserve_timeout_s: float = 30.0, host_bytes: int = 16 << 20
    ) -> LocalCluster:
        cluster = PatchedCluster(
            patch or {},
            redis_url=redis_url,
            namespace=f"t-{uuid.uuid4().hex[:10]}",
            host_bytes=host_bytes,
            reserve_timeout_s=reserve_timeout_s,
            agent_args=["--no-prefault", "--no-spill"],
        )
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in started:
        cluster.stop()


@pytest.fixture
def silent_peer() -> Iterator[SilentPeer]:
    """A peer endpoint that accepts connections and never answers; closed at the end."""
    peer = SilentPeer()
    try:
        yield peer
    finally:
        peer.close()
