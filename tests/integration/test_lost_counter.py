"""Objects whose last copies went with their node are counted `lost`. A node's death took its
single-copy objects, and no counter said so: `evicted` counts what pressure dropped, `short` what
waits for a copy. Now the purge that drops an object's last replica counts it once; a replicated
object that kept a copy on a live node is not lost, and one already counted when it became
unreadable (evicted with the rest on a dead node) is not counted again."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import Client, KeyNotFound, LocalCluster

SINGLE = [f"lost/single/{i}" for i in range(5)]
PAIRED = [f"lost/paired/{i}" for i in range(3)]


def value(key: str) -> np.ndarray:
    return np.full(4096, hash(key) % 251, dtype=np.uint8)


def test_a_dead_nodes_single_copies_are_counted_lost_once_and_replicated_ones_are_not(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, host_bytes=16 << 20, heartbeat_ttl_s=2.0)
    client = make_client(cluster)
    doomed = cluster.agents[1]
    for key in SINGLE:
        client.put(key, value(key), preferred_node=doomed.node_id)
    for key in PAIRED:
        client.put(key, value(key), replicas=2)
    assert client.stat().lost == 0
    doomed.kill()
    # Reaped by the survivor one TTL past its deadline: the purge drops the single copies.
    assert wait_until(lambda: client.stat().lost >= len(SINGLE), 30.0), client.stat()
    for key in SINGLE:
        assert not client.exists(key)
    for key in PAIRED:
        assert np.array_equal(client.get(key), value(key))
    stats = client.stat()
    assert stats.lost == len(SINGLE) and stats.evictions == 0, stats
    assert "lost 5" in repr(stats)
    with pytest.raises(KeyNotFound):
        client.get(SINGLE[0])
