"""A prompt with more new chunks than the cluster's arenas hold at once, even empty (a prefix-cache
probe, 2026-12-07): its store raised NoCapacity, "put it in smaller batches", which a caller of
PrefixCache.store, who chose no batch, cannot do, and stored nothing; match said 0."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster, NoCapacity, PrefixCache, connect
from mooncake_store.agent.node import Agent

KiB = 1 << 10
C = 4  # tokens per chunk
NS = "long-model/u8/L1/kv1/d1/tp0"


def test_a_prompt_longer_than_the_cluster_has_its_first_chunks_stored(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    direct_agent(namespace)  # one agent of 4 MiB, its high watermark at 90%: 14 chunks of 256 KiB
    client = client_of(namespace)
    cache = PrefixCache(client, NS, chunk_tokens=C)
    try:
        # An object under a read lease: cut to fill the arena whole (16 chunks), the store waited
        # for its room, out to the client's timeout, and failed (review of this change).
        client.put("leased", np.zeros(64 * KiB, np.uint8))
        client.index.lookup(["leased"], lease_ms=60_000)
        tokens = list(range(20 * C))
        chunks = [np.full(256 * KiB, i, np.uint8) for i in range(20)]
        assert cache.store(tokens, chunks) == 14
        assert cache.match(tokens) == 14 * C
        with cache.load(tokens) as hit:
            assert hit.num_chunks == 14
            for got, want in zip(hit.chunks, chunks, strict=False):
                assert np.array_equal(got, want)
    finally:
        cache.close()


def test_a_chunk_no_arena_holds_is_named_as_such(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """With a second chunk beside it, the error said "put it in smaller batches" instead."""
    direct_agent(namespace)
    client = client_of(namespace)
    cache = PrefixCache(client, NS, chunk_tokens=C)
    try:
        with pytest.raises(NoCapacity, match=r"the largest host arena is 4194304 B") as caught:
            cache.store(list(range(2 * C)), [np.zeros(5 << 20, np.uint8)] * 2)
        assert caught.value.permanent
        assert cache.match(list(range(2 * C))) == 0
    finally:
        cache.close()


def test_a_prompt_longer_than_the_cluster_stored_again_writes_nothing_and_keeps_its_chain(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """The next request over the same document stores its prompt again: its new chunks counted the
    room its own stored chain holds as room to be made, though the store pins that chain (the
    chunk the new ones hang off), so the put waited out the client's timeout, raised NoCapacity,
    and the pass its room request had started cut the chain back to a few chunks (a probe of
    2026-12-07: from 114 chunks to 1 and to 25)."""
    agent = direct_agent(namespace)  # 4 MiB, its high watermark at 90%: 14 chunks of 256 KiB
    client = client_of(namespace)
    cache = PrefixCache(client, NS, chunk_tokens=C)
    try:
        tokens = list(range(20 * C))
        chunks = [np.full(256 * KiB, i, np.uint8) for i in range(20)]
        assert cache.store(tokens, chunks) == 14
        agent.sync_once()
        agent.heartbeat_once()  # the node table the next store reads says how full it is
        assert cache.store(tokens, chunks) == 0
        assert cache.match(tokens) == 14 * C
        assert not agent.pressure.requests.pending(), "the store asked for room it cannot have"
    finally:
        cache.close()


def test_stored_again_beside_a_small_disk_tier_the_prompt_is_not_refused(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """The judgement above was left out wherever a node had a disk tier (the chain may be demoted
    there): with a small one, each store again waited out the client's timeout and raised
    NoCapacity (a probe: 16 MiB of host beside 8 MiB of disk, every time). The disk now takes what
    of the chain it keeps under its mark, and the rest stays in the host tier beside the new
    chunks: the store writes what fits there, or nothing, and does not fail. Nor is the chain cut
    back by the disk's pass (evict_chains leaves a chain whose later chunks are in the host)."""
    args = ["--no-prefault", "--disk", str(tmp_path / "disk"), "--disk-mem", "8MiB"]
    cluster = make_cluster(1, host_bytes=16 << 20, agent_args=args)
    client = connect(cluster.redis_url, namespace=cluster.namespace, timeout_s=5.0)
    cache = PrefixCache(client, NS, chunk_tokens=C)
    try:
        tokens = list(range(136 * C))
        rng = np.random.default_rng(0)  # incompressible: each chunk file as large as its chunk
        chunks = [rng.integers(0, 256, 256 * KiB, dtype=np.uint8) for _ in range(136)]
        assert cache.store(tokens, chunks) == 57  # the host tier's mark: 57 chunks of 256 KiB
        matched = [57]
        for _ in range(3):
            written = cache.store(tokens, chunks)  # raised NoCapacity after timeout_s
            assert 0 <= written <= 79
            time.sleep(1.5)  # the passes that follow: demotions, and the disk's own
            matched.append(cache.match(tokens) // C)
            with cache.load(tokens) as hit:  # what is matched loads, byte-exact
                for got, want in zip(hit.chunks, chunks, strict=False):
                    assert np.array_equal(got, want)
        # Never cut below what it held: a disk pass wanting room cut the chain at a chunk the
        # host had demoted there, its whole tail in the host with it (57, 48, 40, 32 chunks).
        assert matched == sorted(matched), matched
    finally:
        cache.close()
        client.close()
