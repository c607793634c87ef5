"""A shm-only client whose agent on this host is past its heartbeat deadline, while live agents
on other hosts are listed: its put was "NoCapacity: 1 agent(s) registered, none within its
heartbeat deadline (stalled, or the index was out of reach)", though the table held a live node
and the index answered. It names the live nodes shm does not reach and the stalled one it does,
and stays a NoCapacity: judged on the cached node table, it is judged again on a fresh one, so a
put just after the agent is back within its deadline goes to it."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers import node_row, stop_process, wait_until

from mooncake_store import LocalCluster, NoCapacity, connect
from mooncake_store.index.client import RedisIndex
from mooncake_store.types import TierKind, TierUsage

TTL_S = 2.0


def test_a_shm_only_put_with_its_agent_stalled_names_the_transports_and_the_stalled_agent(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(1, host_bytes=16 << 20, heartbeat_ttl_s=TTL_S)
    index = RedisIndex(cluster.redis_url, namespace=cluster.namespace, timeout_s=10.0)
    far = dataclasses.replace(
        node_row("far", tiers=(TierUsage(tier=TierKind.HOST, capacity_bytes=1 << 30, used_bytes=0),)),
        host_id="another-host",
    )
    index.register_node(far, incarnation="f1", ttl_ms=120_000)
    local = cluster.agents[0]
    client = connect(cluster.redis_url, namespace=cluster.namespace, transports=("shm",), timeout_s=5.0)
    stop_process(local.pid)
    try:
        # Past its deadline (one TTL after its last heartbeat), and not reaped before another TTL.
        assert wait_until(lambda: local.node_id not in live_ids(index), 3 * TTL_S)
        with pytest.raises(NoCapacity) as info:
            client.put("k", np.arange(1024, dtype=np.uint8))
        message = str(info.value)
        assert "no allowed transport ('shm',) reaches a live agent for a put of 'k'" in message, message
        assert "shm reaches only agents on this host (far are not" in message, message
        assert f"those it reaches ({local.node_id}) are past their heartbeat deadline" in message, message
        assert "index was out of reach" not in message, message
    finally:
        os.kill(local.pid, signal.SIGCONT)
    # Back within its deadline, the same client's put goes to it.
    assert wait_until(lambda: local.node_id in live_ids(index), 10.0)
    client.put("k", np.arange(1024, dtype=np.uint8))
    assert client.get("k").tobytes() == np.arange(1024, dtype=np.uint8).tobytes()
    client.close()
    index.close()


def live_ids(index: RedisIndex) -> set[str]:
    now_ms = int(time.time() * 1000)
    return {n.node_id for n in index.nodes().values() if n.heartbeat_deadline_ms >= now_ms}
