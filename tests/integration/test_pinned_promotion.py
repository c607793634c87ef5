"""A PrefixCache load pins its chunks before it reads them, and a chunk read from the disk tier
is promoted back to host memory by a swap that pins used to refuse: the load's own pin held its
chunks on disk for good (every restore of a hot prefix decompressed them through the agent over
TCP, while a plain get of the same keys promoted them). A promotion stays on the node and serves
the pin's holder, so pins no longer hold it back; spills and demotions of pinned chunks still
wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from helpers import host_use_since, wait_until

from mooncake_store import Client, LocalCluster, PrefixCache

MiB = 1 << 20
CHUNK_TOKENS = 16
CHUNKS = 8


def _tiers(client: Client, keys: list[str]) -> list[str]:
    metas = [client.object_meta(k) for k in keys]
    return [str(m.replicas[0].tier) if m else "-" for m in metas]


def test_a_prefix_load_promotes_its_pinned_chunks_from_disk(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    cluster = make_cluster(0)
    disk = ["--disk", str(tmp_path / "disk"), "--disk-mem", str(64 * MiB)]
    watermarks = ["--high-watermark", "0.6", "--low-watermark", "0.4", "--no-spill"]
    cluster.add_agent(node_id="agent-0", extra_args=["--host-bytes", str(16 * MiB), *disk, *watermarks])
    client = make_client(cluster, lease_ms=300)
    cache = PrefixCache(client, "promote/u64/L1/kv1/d8/tp0", chunk_tokens=CHUNK_TOKENS)
    ids = np.arange(CHUNKS * CHUNK_TOKENS, dtype=np.int64)
    chunks = [np.full(64 << 10, i, dtype=np.uint64) for i in range(CHUNKS)]  # 512 KiB each
    assert cache.store(ids, chunks) == CHUNKS
    keys = cache.keys(ids)
    filler = [f"filler{i}" for i in range(14)]
    for key in filler:  # 14 MiB more: the colder chain goes to disk
        client.put(key, np.zeros(MiB, np.uint8))
        time.sleep(0.05)
    assert wait_until(lambda: _tiers(client, keys).count("disk") >= CHUNKS // 2, 20), _tiers(client, keys)
    client.remove_many(filler)
    removed = time.monotonic()
    # Their read leases end, their memory is freed and a heartbeat after the removal publishes it
    # (an older one may show the tier before the filler came): room to promote the whole chain
    # into under the high watermark (9.6 MiB), which a read does only then.
    assert wait_until(lambda: host_use_since(client, removed) <= 4 * MiB, 10), client.stat().nodes[0]
    for _ in range(2):
        with cache.load(ids) as hit:
            assert hit.num_chunks == CHUNKS
            assert all(int(c[0]) == i and int(c[-1]) == i for i, c in enumerate(hit.chunks))
    assert wait_until(lambda: _tiers(client, keys) == ["host"] * CHUNKS, 10), _tiers(client, keys)
    cache.close()
