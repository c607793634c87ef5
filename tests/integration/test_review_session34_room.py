"""Room a put waits for is asked for in what its objects take in the arena (64 B units, one at
least), not in their raw sizes: 3000 one-byte objects asked for 3000 B, which a free block of
178 KiB already held, and the pressure pass made no room for the 192,000 B they take."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mooncake_store import Client, LocalCluster

KiB = 1 << 10


def test_a_batch_of_tiny_objects_gets_the_room_they_take(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1, host_bytes=1024 * KiB)
    client = make_client(cluster, timeout_s=8)
    for i in range(17):  # ~83%: under the high watermark, nothing moves on its own
        client.put(f"big{i}", np.full(50 * KiB, i, dtype=np.uint8))
    tiny = {f"t{i}": np.full(1, 7, dtype=np.uint8) for i in range(3000)}
    client.put_many(tiny)  # NoCapacity after timeout_s before: "need 3000 B ... 178176 B free"
    assert np.array_equal(client.get("t2999"), np.full(1, 7, dtype=np.uint8))
