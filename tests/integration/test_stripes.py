"""Objects above stripe_bytes go over TCP in stripes, the extra ones on a pool of threads shared
by every peer and thread of the client. Threads whose stripes waited on a stalled agent held
that pool's workers for up to timeout_s, and a striped read from a healthy agent queued behind
them (4.7 s of a 5 s timeout for an 8 ms read). A stripe still queued when its caller is done
with its own is now run by the caller."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import numpy as np
from helpers import requests_waiting_at, stop_process, wait_until

from mooncake_store import Client, LocalCluster, MooncakeError

MiB = 1 << 20


def test_a_striped_read_from_a_healthy_agent_does_not_wait_for_a_stalled_ones(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, host_bytes=64 * MiB)
    options = {"transports": ("tcp",), "tcp_connections": 2, "stripe_bytes": MiB}
    writer = make_client(cluster, **options)
    values = {
        node: np.random.default_rng(i).integers(0, 255, 4 * MiB, dtype=np.uint8)
        for i, node in enumerate(("agent-0", "agent-1"))
    }
    for node, value in values.items():
        writer.put(f"on-{node}", value, preferred_node=node)
    client = make_client(cluster, timeout_s=20.0, **options)
    assert np.array_equal(client.get("on-agent-1"), values["agent-1"])  # connections to both made
    assert np.array_equal(client.get("on-agent-0"), values["agent-0"])
    stalled = cluster.agent("agent-0")
    stop_process(stalled.pid)  # every thread stopped: none reads a READ sent from here on
    ended: list[str] = []
    try:

        def read_stalled() -> None:
            try:
                client.get("on-agent-0")
                ended.append("read")
            except MooncakeError as exc:
                ended.append(type(exc).__name__)

        stuck = [threading.Thread(target=read_stalled) for _ in range(2)]
        for thread in stuck:
            thread.start()
        # Their stripes hold both of the pool's workers once all four READs (two per read, one on
        # the caller's thread, one on the pool) wait at the stalled agent; a fixed sleep let the
        # healthy read run first on a loaded machine, and pass without testing anything.
        assert wait_until(lambda: requests_waiting_at(stalled.endpoint) >= 4, 10), requests_waiting_at(stalled.endpoint)
        assert np.array_equal(client.get("on-agent-1"), values["agent-1"])
        assert ended == [], "the healthy read finished only after the stalled reads gave up"
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
        for thread in stuck:
            thread.join(60)
    assert len(ended) == 2
