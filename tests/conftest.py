"""Shared fixtures: one real Redis-compatible server per test session (each test isolates itself
with its own namespace), and real agent subprocesses through LocalCluster."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.agent.node import Agent
from mooncake_store.config import AgentConfig
from mooncake_store.embedded import EmbeddedServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedServer]:
    # A watchdog stops it should pytest be killed (a CI timeout, the OOM killer): it runs in a
    # session of its own, which nothing else would stop.
    server = EmbeddedServer(exit_with_parent=True).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedServer) -> str:
    return redis_server.url


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_cluster(redis_url: str) -> Iterator[Callable[..., LocalCluster]]:
    """Start LocalClusters on the session server, each in a namespace of its own; all stopped at the end."""
    clusters: list[LocalCluster] = []

    def make(num_agents: int = 2, **kwargs: object) -> LocalCluster:
        kwargs.setdefault("host_bytes", 64 << 20)
        cluster = LocalCluster(
            num_agents,
            redis_url=redis_url,
            namespace=f"t-{uuid.uuid4().hex[:10]}",
            **kwargs,  # type: ignore[arg-type]
        )
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster(2)


@pytest.fixture
def make_client() -> Iterator[Callable[..., Client]]:
    clients: list[Client] = []

    def make(cluster: LocalCluster, **kwargs: object) -> Client:
        client = connect(cluster.redis_url, namespace=cluster.namespace, **kwargs)  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def client(cluster: LocalCluster, make_client: Callable[..., Client]) -> Client:
    return make_client(cluster)


@pytest.fixture(scope="session")
def shared_cluster(redis_server: EmbeddedServer) -> Iterator[LocalCluster]:
    """Two 64 MiB agents for tests that only need *a* cluster and use keys of their own."""
    with LocalCluster(2, redis_url=redis_server.url, host_bytes=64 << 20) as cluster:
        yield cluster


@pytest.fixture
def shared_client(shared_cluster: LocalCluster, make_client: Callable[..., Client]) -> Client:
    return make_client(shared_cluster)


@pytest.fixture
def make_inproc_agent(redis_url: str) -> Iterator[Callable[..., Agent]]:
    """Real Agents in the test process, each in a namespace of its own, whose sync runs only when a
    test (or a server thread) calls it: for placing an interleaving exactly. All stopped at the end."""
    agents: list[Agent] = []

    def make(
        *, namespace: str | None = None, prepare: Callable[[Agent], None] | None = None, **overrides: Any
    ) -> Agent:
        """``namespace``: agents that must see one another share one; ``prepare`` runs before start."""
        settings: dict[str, Any] = {
            "node_id": f"rv-{uuid.uuid4().hex[:6]}",
            "host_bytes": 4 << 20,
            "sync_interval_s": 3600.0,  # the sync loop never fires on its own
            "reserve_timeout_s": 0.5,
            "prefault": False,
            "spill_to_peers": False,
        }
        settings.update(overrides)
        agent = Agent(AgentConfig(**settings), redis_url=redis_url, namespace=namespace or f"t-{uuid.uuid4().hex[:10]}")
        if prepare is not None:
            prepare(agent)
        agents.append(agent)
        agent.start()
        return agent

    yield make
    for agent in agents:
        agent.stop()


@pytest.fixture
def make_peer_agent(make_inproc_agent: Callable[..., Agent]) -> Callable[..., Agent]:
    """In-process Agents in one namespace, so that they spill to one another, with heartbeats that
    never lapse; their pressure loop does nothing unless ``real_pressure``: the test drives the
    Spiller itself."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"

    def make(*, real_pressure: bool = False, **overrides: Any) -> Agent:
        settings: dict[str, Any] = {
            "node_id": f"peer-{uuid.uuid4().hex[:6]}",
            "heartbeat_interval_s": 600.0,
            "heartbeat_ttl_s": 1200.0,
            "reserve_timeout_s": 30.0,
            "spill_to_peers": True,
            **overrides,
        }

        def prepare(agent: Agent) -> None:
            if not real_pressure:
                agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]

        return make_inproc_agent(namespace=namespace, prepare=prepare, **settings)

    return make


@pytest.fixture
def clients() -> Iterator[Callable[..., Client]]:
    """Clients of an in-process agent's namespace (``clients(agent, **connect_kwargs)``), closed at
    the end."""
    made: list[Client] = []

    def make(agent: Agent, **kwargs: object) -> Client:
        c = connect(agent.index.url, namespace=agent.namespace, **kwargs)  # type: ignore[arg-type]
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
