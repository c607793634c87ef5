"""An index restored from a snapshot older than the agents' last heartbeats (a Redis restarted
from its last RDB save, say) names memory the agents have freed and used again since: a same-host
read copied another object's bytes under the old key, and the memory the restored index no longer
named stayed allocated for good. Agents now see the index's count of their heartbeats go back,
take their nodes' replicas out of it and start afresh."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mooncake_store import KeyNotFound, LocalCluster, connect
from mooncake_store.embedded import EmbeddedServer

KiB = 1 << 10


def test_an_index_restored_from_an_older_snapshot_never_serves_other_bytes() -> None:
    server = EmbeddedServer().start()
    try:
        namespace = "rollback"
        prefix = f"mc:{{{namespace}}}:".encode()
        with (
            LocalCluster(1, redis_url=server.url, namespace=namespace, host_bytes=16 << 20),
            connect(server.url, namespace=namespace, lease_ms=300) as client,
        ):
            raw = server.client()
            values = {f"a{i}": np.full(256 * KiB, i, np.uint8) for i in range(10)}
            client.put_many(values)
            kept = {f"c{i}": np.full(128 * KiB, 50 + i, np.uint8) for i in range(4)}  # untouched since
            client.put_many(kept)
            time.sleep(1.5)  # a heartbeat lands after the puts: the snapshot has it
            snapshot = {k: raw.dump(k) for k in raw.scan_iter(match=prefix + b"*", count=1000)}
            client.remove_many([f"a{i}" for i in range(5)])
            client.put_many({f"a{i}": np.full(256 * KiB, 100 + i, np.uint8) for i in range(5, 10)})
            time.sleep(1.0)  # the leases run out, the graves are freed...
            client.put_many({f"b{i}": np.full(256 * KiB, 200 + i, np.uint8) for i in range(10)})  # ...and used again
            time.sleep(2.5)  # heartbeats after the snapshot's
            # In one transaction, as a restart would: no heartbeat may see the keys half gone.
            restore = raw.pipeline(transaction=True)
            for key in raw.scan_iter(match=prefix + b"*", count=1000):
                restore.delete(key)
            for key, dumped in snapshot.items():
                restore.restore(key, 0, dumped, replace=True)
            restore.execute()
            # The agent's next heartbeat finds the count gone back and drops the replicas of
            # memory it no longer holds: every a (removed or replaced since the snapshot).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(client.exists(k) for k in values):
                time.sleep(0.1)
            for key in values:
                with pytest.raises(KeyNotFound):
                    client.get(key)
            for key, value in kept.items():  # what the snapshot and the agent agree on stays
                assert np.array_equal(client.get(key), value), key
            # The node is registered again and serves new objects; its old memory comes back.
            fresh = np.arange(64 * KiB, dtype=np.uint8)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.put("fresh", fresh)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert np.array_equal(client.get("fresh"), fresh)
            client.remove("fresh")
            # The b's memory, committed after the snapshot, is named nowhere: freed after a
            # default read lease. What stays allocated is the c's.
            want = sum(v.nbytes for v in kept.values())
            deadline = time.monotonic() + 15
            used = None
            while time.monotonic() < deadline:
                (node,) = client.stat().nodes
                used = sum(t.used_bytes for t in node.tiers)
                if used == want:
                    break
                time.sleep(0.3)
            assert used == want, f"{used} B allocated for {want} B of objects the restored index names"
    finally:
        server.stop()
