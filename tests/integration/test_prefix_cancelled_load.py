"""A load_async its caller cancelled (asyncio.wrap_future(...).cancel()) while it ran (a prefix-cache
probe, 2026-12-07): the load finished all the same and its hit, which no one could release, kept
its chunks pinned until the cache's renewal thread came round, 10 s by default (a third of the
pin lease): remove raised ObjectPinned meanwhile, and no pass could evict them. The renewal
thread now unpins hits dropped without release() within a quarter second."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import Client, PrefixCache

pytestmark = pytest.mark.timeout(60)

C = 16
NS = "cancelled-load/u8/L1/kv1/d1/tp0"


def test_a_hit_dropped_without_release_is_unpinned_with_no_further_call(client: Client) -> None:
    cache = PrefixCache(client, NS + "/plain", chunk_tokens=C)
    try:
        tokens = list(range(4 * C))
        assert cache.store(tokens, [np.full(64 << 10, i, np.uint8) for i in range(4)]) == 4
        hit = cache.load(tokens)
        assert cache.refcounts(tokens) == [1] * 4
        del hit
        gc.collect()
        # No load, store or match of this cache: only its renewal thread, whose renewals are 10 s apart.
        assert wait_until(lambda: cache.refcounts(tokens) == [0] * 4, 3.0)
        assert client.remove_many(cache.keys(tokens)) == [True] * 4
    finally:
        cache.close()


def test_a_cancelled_load_async_leaves_its_chunks_removable(client: Client) -> None:
    cache = PrefixCache(client, NS + "/cancelled", chunk_tokens=C)
    try:
        tokens = list(range(8 * C))
        assert cache.store(tokens, [np.full(1 << 20, i, np.uint8) for i in range(8)]) == 8
        loads = [cache.load_async(tokens)]
        # Cancelled once it runs (or ran): cancelled before, it would pin nothing at all.
        assert wait_until(lambda: loads[0].running() or loads[0].done(), 10.0)

        async def cancel_the_load() -> None:
            future = asyncio.wrap_future(loads[0])
            future.cancel()
            with pytest.raises(asyncio.CancelledError):
                await future

        asyncio.run(cancel_the_load())
        assert not loads[0].cancelled()  # it ran on, and its hit waits in a future no one reads
        assert loads[0].result(timeout=10).num_chunks == 8
        assert cache.refcounts(tokens) == [1] * 8
        loads.clear()
        gc.collect()
        assert wait_until(lambda: cache.refcounts(tokens) == [0] * 8, 3.0)
        assert client.remove_many(cache.keys(tokens)) == [True] * 8
    finally:
        cache.close()
