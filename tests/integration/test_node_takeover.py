"""An agent that stalls past its heartbeat deadline and finds its node id taken over when it wakes
stops, with exit status 1 and a message saying why (it used to drop its memory and log an error on
every heartbeat, forever, serving nothing). Real agent processes and the session's real Valkey."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import numpy as np
from helpers import wait_until

from mooncake_store import Client, LocalCluster


def test_a_stalled_agent_whose_node_id_was_taken_over_stops(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0, heartbeat_ttl_s=1.5)
    old = cluster.add_agent(node_id="x")
    os.kill(old.pid, signal.SIGSTOP)
    try:
        client = make_client(cluster)
        assert wait_until(lambda: not client.stat().nodes or client.stat().nodes[0].alive is False, 10), client.stat()
        time.sleep(0.5)  # past the deadline: a new incarnation may take the id over
        new = cluster.add_agent(node_id="x")
    finally:
        os.kill(old.pid, signal.SIGCONT)
    code = old.process.wait(timeout=20)
    assert code == 1, code
    log = old.log_tail()
    assert "taken over" in log, log
    assert new.alive()
    client.put("after", np.arange(1024, dtype=np.uint8))
    assert np.array_equal(client.get("after"), np.arange(1024, dtype=np.uint8))
    (node,) = client.stat().nodes
    assert node.node_id == "x" and node.pid == new.pid
