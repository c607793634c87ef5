"""A node reaped while it stalled, back under the same incarnation (review, thirty-third session):
it keeps its start (stat's uptime: "the counters count from its start") and its own counters,
and the purge deleted its hit counters in the index, so stat showed it up since its start with
fewer hits than the reads it served."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import numpy as np
from helpers import stop_process, wait_until

from mooncake_store import Client, LocalCluster
from mooncake_store.client.stats import NodeStats, TierStats
from mooncake_store.types import TierKind


def host_tier(client: Client, node_id: str) -> tuple[NodeStats, TierStats]:
    (node,) = (n for n in client.stat().nodes if n.node_id == node_id)
    (tier,) = (t for t in node.tiers if t.tier == TierKind.HOST)
    return node, tier


def test_hits_survive_a_reap_the_node_comes_back_from(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, heartbeat_ttl_s=1.5)
    client = make_client(cluster, timeout_s=5.0, transports=("tcp",))
    value = np.arange(4096, dtype=np.uint8)
    client.put("h", value, replicas=2, preferred_node="agent-0")
    for _ in range(5):
        assert np.array_equal(client.get("h"), value)
    assert sum(t.hits for n in client.stat().nodes for t in n.tiers) == 5
    node0, tier0 = host_tier(client, "agent-0")
    agent = cluster.agent("agent-0")
    stop_process(agent.pid)
    try:
        assert wait_until(lambda: "agent-0" not in client.index.nodes(), 15), "never reaped"
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    assert wait_until(lambda: "agent-0" in client.index.nodes(), 10)
    time.sleep(1.0)  # a heartbeat or two
    node0_after, tier0_after = host_tier(client, "agent-0")
    assert node0_after.started_ms == node0.started_ms  # the same start: its counters count from it
    assert tier0_after.reads >= tier0.reads  # the agent's own counter went on
    assert tier0_after.hits == tier0.hits, f"agent-0's hits went from {tier0.hits} to {tier0_after.hits}"


def test_a_new_incarnation_counts_hits_afresh(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """What the purge keeps goes back to the incarnation it was taken from only: a restarted agent
    under the same node id starts from zero, as its other counters do."""
    cluster = make_cluster(1, heartbeat_ttl_s=1.0)
    client = make_client(cluster, timeout_s=5.0, transports=("tcp",))
    client.put("h", np.arange(4096, dtype=np.uint8))
    for _ in range(3):
        client.get("h")
    assert host_tier(client, "agent-0")[1].hits == 3
    cluster.agent("agent-0").kill()
    cluster.add_agent(node_id="agent-0")  # waits out the dead one's deadline, then purges its record
    assert host_tier(client, "agent-0")[1].hits == 0
