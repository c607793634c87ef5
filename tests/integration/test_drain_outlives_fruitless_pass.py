"""A drain that starts past a tier's high watermark goes on down to the low one even when a pass
between the two finds nothing it may move yet (pinned, or read and still leased): those objects
become movable later, and the tier must not be left sitting between its watermarks for good. Such
passes back off meanwhile (each is a victim sample the index runs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import host_use_since, wait_until
from test_pressure import pin, replica_nodes, unpin, value_for

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.agent.drains import DRAIN_RETRY_MAX_S
from mooncake_store.agent.node import Agent

MiB = 1 << 20
HOST = 16 * MiB


def test_drain_goes_on_after_a_pass_that_found_only_pinned_objects(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    cluster = make_cluster(0)
    cluster.add_agent(
        node_id="agent-0", extra_args=["--host-bytes", str(HOST), "--disk", str(tmp_path), "--disk-mem", str(64 * MiB)]
    )
    client = make_client(cluster, lease_ms=300, timeout_s=20)
    pinned = [f"pinned/{i:02d}" for i in range(13)]
    for key in pinned:  # 13 of 16 MiB: between the low (0.75) and the high (0.90) watermark
        client.put(key, value_for(key))
        pin(client, key)
    loose = ["loose/0", "loose/1"]
    for key in loose:  # 15 of 16 MiB: past the high watermark, a drain starts
        client.put(key, value_for(key))
    # The loose objects go to disk; then the drain's passes find only pinned objects, with the
    # tier still above its low watermark.
    assert wait_until(lambda: all(replica_nodes(client, k)[0][1] == "disk" for k in loose), 20), [
        replica_nodes(client, k) for k in loose
    ]
    time.sleep(1.0)
    assert all(replica_nodes(client, k)[0][1] == "host" for k in pinned)
    unpin(client, pinned)  # the pins are released: the drain can go on
    unpinned = time.monotonic()
    assert wait_until(lambda: host_use_since(client, unpinned) <= 0.75 * HOST, 10), client.stat().nodes[0]
    moved = [k for k in pinned if replica_nodes(client, k)[0][1] == "disk"]
    assert moved, "no object left the host tier once the pins were released"
    for key in [*pinned, *loose]:
        assert (client.get(key) == value_for(key)).all(), key


def test_a_drain_held_up_by_pins_samples_the_index_less_and_less_often(
    make_inproc_agent: Callable[..., Agent],
) -> None:
    """Between the watermarks, a drain whose passes find only pinned objects retried every
    interval (0.2 s): a victim sample of 256 objects five times a second for as long as the pins
    lasted, on every such node. Its passes now wait twice as long each time, up to
    DRAIN_RETRY_MAX_S, and it still goes on once the pins are gone."""
    agent = make_inproc_agent(host_bytes=HOST, reserve_timeout_s=5.0)
    client = connect(agent.index.url, namespace=agent.namespace, timeout_s=20)
    samples: list[float] = []
    real_sample = agent.index.victim_candidates

    def counted_sample(*args: Any, **kwargs: Any) -> Any:
        samples.append(time.monotonic())
        return real_sample(*args, **kwargs)

    agent.index.victim_candidates = counted_sample  # type: ignore[method-assign]
    try:
        pinned = [f"pinned/{i:02d}" for i in range(13)]
        for key in pinned:
            client.put(key, value_for(key))
            pin(client, key)
        for key in ("loose/0", "loose/1"):  # past the high watermark: no disk, no peer, evicted
            client.put(key, value_for(key))
        agent.sync_once()
        assert wait_until(lambda: not client.exists("loose/0") and not client.exists("loose/1"), 20)
        window_s = 4.0
        start = time.monotonic()
        time.sleep(window_s)
        during = [t for t in samples if t >= start]
        # At one per 0.2 s interval this was ~20; backing off, about one per DRAIN_RETRY_MAX_S.
        assert len(during) <= 2 * window_s / DRAIN_RETRY_MAX_S + 4, (
            f"{len(during)} victim samples in {window_s} s of a drain held up by pins"
        )
        assert agent.table.usage()[0] > 0.75 * HOST  # still between the watermarks
        unpin(client, pinned)
        assert wait_until(lambda: agent.table.usage()[0] <= 0.75 * HOST, 10), agent.table.usage()
    finally:
        client.close()
