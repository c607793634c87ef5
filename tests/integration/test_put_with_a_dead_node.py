"""A put of replicas=2 on a cluster of two nodes, one of them dead (past its heartbeat deadline,
not yet reaped), fails at once naming the dead node and why it was left out, as a put that fewer
than N live nodes keep does. It took one dead node among live ones for an index outage (every node
past its deadline), waited for the node's reap, then failed without naming it."""

from __future__ import annotations

import pytest
from helpers import wait_until

from mooncake_store import LocalCluster, NoCapacity, connect


def test_replicas_2_with_one_of_two_nodes_dead_fails_naming_it() -> None:
    with (
        LocalCluster(2, host_bytes=16 << 20, heartbeat_ttl_s=3) as cluster,
        connect(cluster.redis_url, namespace=cluster.namespace, timeout_s=10) as client,
    ):
        client.put("warm", b"x", replicas=2)
        cluster.agents[1].kill()

        def dead() -> bool:
            nodes = {n.node_id: n for n in client.stat().nodes}
            return "agent-1" in nodes and not nodes["agent-1"].alive

        # Past its deadline (about 3 s), and not reaped before another 3 s have passed.
        assert wait_until(dead, timeout_s=15, interval_s=0.1)
        with pytest.raises(NoCapacity) as refused:
            client.put("k", b"y" * 1000, replicas=2)
        message = str(refused.value)
        assert "agent-1" in message and "heartbeat deadline" in message, message
        assert bytes(client.get("warm")) == b"x"  # the live node's copy
