"""After the index server restarts empty, an agent holds the memory of the objects the index lost
for a read lease (5 s) before it frees it (README: an agent whose record vanished with no purge).
Its pressure pass counted that held memory as used and, since nothing the index names there could
be moved but the objects put since, evicted the puts made right after the restart, into room the
arena had, for memory that came back by itself a few seconds later. Held memory now counts as
memory coming back, as a grave's does."""

from __future__ import annotations

import time

import numpy as np
from helpers import wait_until

from mooncake_store import LocalCluster, connect
from mooncake_store.embedded import EmbeddedServer

MiB = 1 << 20


def test_puts_right_after_an_empty_index_restart_are_not_evicted_for_the_held_memory() -> None:
    server = EmbeddedServer().start()
    try:
        with LocalCluster(1, redis_url=server.url, namespace="hold", host_bytes=8 * MiB) as cluster:
            client = connect(cluster.redis_url, namespace="hold", timeout_s=15)
            try:
                for i in range(6):  # 6 MiB of 8: 75 %, under the high watermark (90 %)
                    client.put(f"old{i}", np.full(MiB, 1, dtype=np.uint8))
                time.sleep(1.0)  # the agent has taken in the commits
                port = server.port
                server.stop()
                server = EmbeddedServer(port=port).start()  # the same port, empty
                for i in range(2):  # 2 MiB: the arena's free room; the old 6 MiB are held 5 s
                    client.put(f"new{i}", np.full(MiB, i + 2, dtype=np.uint8))

                def host_used() -> int:
                    return client.stat().nodes[0].tiers[0].used_bytes

                # The hold ends and the old objects' memory is freed (all of it, on the old code:
                # the new objects were evicted too).
                assert wait_until(lambda: host_used() <= 2 * MiB, timeout_s=30), f"{host_used()} B used"
                kept = [i for i in range(2) if client.exists(f"new{i}")]
                stats = client.stat()
                assert kept == [0, 1], (
                    f"objects put after the restart were evicted (kept {kept} of [0, 1]) while the "
                    f"arena held only memory the index no longer names: {stats!r}"
                )
                for i in range(2):
                    assert np.array_equal(client.get(f"new{i}"), np.full(MiB, i + 2, dtype=np.uint8))
            finally:
                client.close()
    finally:
        server.stop()
