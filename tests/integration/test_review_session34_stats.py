"""stat()'s hits and misses count a prefix load's chunks once, into device buffers too (each read
there on its own, the batch stopping at the first that fails). Real agents and index; only the
CUDA runtime under the device path is a stand-in (tests/cuda_stand_in.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from cuda_stand_in import HostBackedDeviceArray, HostRuntime, stand_in_cupy

from mooncake_store import Client, LocalCluster
from mooncake_store.client.prefix import PrefixCache

MiB = 1 << 20


def test_a_prefix_load_into_device_buffers_counts_each_chunk_once(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The load's fallback, after its batch read failed, took the chunks for uncounted only if the
    batch had counted all of them; into device buffers it stops at the failed one, so the chunks
    before it (and the failed one) were counted again: 2 hits and 2 misses for 1 and 1."""
    cluster = make_cluster(2, host_bytes=8 * MiB, heartbeat_ttl_s=60)
    client = make_client(cluster, pin_shared_arenas=False)  # the stand-in pins nothing
    cache = PrefixCache(client, "stat-dev/f32/L1/kv1/d8/tp0", chunk_tokens=4)
    tokens = np.arange(12, dtype=np.int64)
    chunks = [np.full(64, i + 1, np.float32) for i in range(3)]
    # Chunk 0 and 2 on agent-0, chunk 1 on agent-1 (each store adds the chunks not yet there).
    cache.store(tokens[:4], chunks[:1], preferred_node="agent-0")
    cache.store(tokens[:8], chunks[:2], preferred_node="agent-1")
    cache.store(tokens, chunks, preferred_node="agent-0")
    holders = [client.object_meta(k).replicas[0].node_id for k in cache.keys(tokens)]  # type: ignore[union-attr]
    assert holders == ["agent-0", "agent-1", "agent-0"]
    real_match = cache.index.match
    index = client.index

    def match_then_node_dies(*args: Any, **kwargs: Any) -> Any:
        found = real_match(*args, **kwargs)
        # agent-1 dies right after the match (SIGKILL, by its pid), and its heartbeat deadline has
        # passed when the chunks are read (set so here rather than waiting out the TTL).
        cluster.agent("agent-1").kill()
        index.redis.zadd(index.prefix + "hb", {"agent-1": 1})
        return found

    cache.index.match = match_then_node_dies  # type: ignore[method-assign]
    backing = [np.zeros(64, np.float32) for _ in range(3)]
    outs = [HostBackedDeviceArray(b, (64,), "<f4") for b in backing]
    base = client.stat()
    try:
        with stand_in_cupy(HostRuntime()), cache.load(tokens, outs=outs) as hit:
            assert hit.num_chunks == 1  # the run up to the chunk that went with its node
            assert np.array_equal(backing[0], chunks[0])
        after = client.stat()
        assert (after.hits - base.hits, after.misses - base.misses) == (1, 1)
    finally:
        cache.close()
