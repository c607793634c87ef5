"""LocalCluster misuse (review, thirty-third session): a second start() tore a running cluster
down (its objects lost) or left its first private server running; add_agent's extra_args were
taken unchecked."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from mooncake_store import ConfigError, LocalCluster, connect


@pytest.fixture
def own_cluster() -> Iterator[Callable[..., LocalCluster]]:
    made: list[LocalCluster] = []

    def make(**kwargs: object) -> LocalCluster:
        cluster = LocalCluster(1, host_bytes=8 << 20, **kwargs)  # type: ignore[arg-type]
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()


def test_a_second_start_leaves_a_running_cluster_as_it_is(
    redis_url: str, own_cluster: Callable[..., LocalCluster]
) -> None:
    """On a shared server the second start's agents found their node ids held, and the refusal
    stopped every agent, the running ones too."""
    cluster = own_cluster(redis_url=redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}").start()
    pids = [a.pid for a in cluster.agents]
    client = connect(cluster.redis_url, namespace=cluster.namespace)
    try:
        client.put("precious", b"bytes")
        assert cluster.start() is cluster
        assert [a.pid for a in cluster.agents] == pids and all(a.alive() for a in cluster.agents)
        assert client.get("precious").tobytes() == b"bytes"
    finally:
        client.close()


def test_a_second_start_keeps_the_private_server_that_stop_stops(own_cluster: Callable[..., LocalCluster]) -> None:
    """With a server of its own, the second start started another and forgot the first, which
    stop() then left running."""
    cluster = own_cluster().start()
    first = cluster.server
    assert first is not None
    with cluster as again:  # __enter__ on a started cluster, as before
        assert again is cluster and cluster.server is first
    assert cluster.server is None  # __exit__ stopped it
    cluster.start()
    second = cluster.server
    assert second is not None and second is not first
    assert cluster.start() is cluster and cluster.server is second


@pytest.mark.parametrize("extra_args", ["--no-spill", ["--no-spill", 5], [b"--no-spill"]])
def test_add_agent_refuses_what_the_constructor_refuses(
    redis_url: str, own_cluster: Callable[..., LocalCluster], extra_args: object
) -> None:
    cluster = own_cluster(redis_url=redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}").start()
    with pytest.raises(ConfigError, match="extra_args must be a list of str"):
        cluster.add_agent(node_id="extra", extra_args=extra_args)  # type: ignore[arg-type]
    assert [a.node_id for a in cluster.agents] == ["agent-0"]


def test_add_agent_takes_a_tuple_as_the_constructor_does(
    redis_url: str, own_cluster: Callable[..., LocalCluster]
) -> None:
    cluster = own_cluster(redis_url=redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}", agent_args=("--no-spill",))
    cluster.start()
    agent = cluster.add_agent(node_id="extra", extra_args=("--no-spill-shm",))
    assert agent.alive() and [a.node_id for a in cluster.agents] == ["agent-0", "extra"]
