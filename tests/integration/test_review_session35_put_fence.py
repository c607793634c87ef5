"""A same-host (shm) put whose agent dies after granting the room, before the FENCE goes out
(review, thirty-fifth session): the FENCE was the one step of a put's writes not marked as that
node's failure, so its ConnectError ended the put instead of placing it again without the node, as
the README promises and a TCP write already did (test_faults.py). The agent is killed by its PID
from inside the put, between its RESERVE and its FENCE."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mooncake_store import Client, LocalCluster


def test_shm_put_whose_agent_dies_after_reserve_lands_on_another_node(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, heartbeat_ttl_s=30.0)
    client = make_client(cluster, timeout_s=3.0)  # default transports: shm on this host
    value = np.random.default_rng(5).integers(0, 255, 1 << 20, dtype=np.uint8)
    client.put("warm", b"x")  # node table, arenas mapped, pooled connections in place
    writes = client._puts.writes
    real_fence = writes.fence
    killed: list[str] = []

    def kill_then_fence(node: Any, group: Any) -> Any:
        if not killed:
            victim = cluster.agent(node.node_id)
            killed.append(node.node_id)
            victim.kill()
            victim.process.wait(10)
        return real_fence(node, group)

    writes.fence = kill_then_fence  # type: ignore[method-assign]
    # README: "A put whose agent dies (or breaks) after granting the room and before the bytes
    # land is placed again without that node" (the TCP twin of this is test_faults.py's).
    client.put("moved-on", value)
    assert killed
    meta = client.object_meta("moved-on")
    assert meta is not None and [r.node_id for r in meta.replicas] != killed
    assert np.array_equal(client.get("moved-on"), value)


def test_shm_replicas2_put_whose_second_agent_dies_after_reserve_lands_on_the_third(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """replicas=2 over three same-host agents: the second replica's agent is SIGKILLed between
    RESERVE and FENCE. The put should place that copy on the third node (as it does over TCP)."""
    cluster = make_cluster(3, heartbeat_ttl_s=30.0)
    client = make_client(cluster, timeout_s=3.0)
    value = np.random.default_rng(6).integers(0, 255, 1 << 20, dtype=np.uint8)
    client.put("warm", b"x", replicas=3)
    reserver = client._puts.reserver
    real_reserve = reserver.reserve
    killed: list[str] = []

    def reserve_then_kill(plans: Any, replicas: int, preferred_node: Any, **kw: Any) -> Any:
        nodes = real_reserve(plans, replicas, preferred_node, **kw)
        if not killed:
            victim = plans[0].replicas[1].node_id
            killed.append(victim)
            cluster.agent(victim).kill()
            cluster.agent(victim).process.wait(10)
        return nodes

    reserver.reserve = reserve_then_kill  # type: ignore[method-assign]
    client.put("two", value, replicas=2)
    meta = client.object_meta("two")
    assert meta is not None and killed[0] not in [r.node_id for r in meta.replicas]
    assert len(meta.replicas) == 2
    assert np.array_equal(client.get("two"), value)
