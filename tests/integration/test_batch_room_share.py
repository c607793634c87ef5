"""A batch planned while no node had room for all of it is stacked on the best-ranked node (here 3
of 4 x 6 MiB objects on one 16 MiB agent), and that node, refusing, was asked to make room for
all of them together: more than its whole arena, so it refused every ask until timeout_s, and the
put failed blaming pinned or leased objects that did not exist, though each node could make room
for its share (a cold 12 MiB object evicted). Each node is now asked for what it keeps."""

from __future__ import annotations

import numpy as np
from helpers import wait_until

from mooncake_store import LocalCluster, connect

MiB = 1 << 20


def test_a_batch_that_fits_once_a_cold_object_goes_is_stored() -> None:
    with (
        LocalCluster(2, host_bytes=16 * MiB) as cluster,
        connect(cluster.redis_url, namespace=cluster.namespace, timeout_s=15) as client,
    ):
        client.put("cold", np.full(12 * MiB, 1, np.uint8))  # nothing reads or pins it

        def published() -> bool:  # the node table shows its use (heartbeat)
            return sum(n.tiers[0].used_bytes for n in client.stat().nodes) >= 12 * MiB

        assert wait_until(published, timeout_s=10)
        values = {f"q{i}": np.full(6 * MiB, i, np.uint8) for i in range(4)}
        client.put_many(values)
        for key, value in values.items():
            assert np.array_equal(client.get(key), value)
