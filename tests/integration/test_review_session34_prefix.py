"""A hit dropped unreleased together with its cache (a cache per request, neither closed): its pins
went into the cache's queue of dropped hits, which was collected with the cache, and nothing
unpinned them; they held their chunks (no remove, no eviction, no move) for the whole lease."""

from __future__ import annotations

import gc
import weakref

import numpy as np
from helpers import wait_until

from mooncake_store import Client, PrefixCache

C = 8
NS = "dropped-with-cache/f32/L1/kv1/d8/tp0"


def test_a_hit_dropped_with_its_cache_is_unpinned_before_its_lease_ends(client: Client) -> None:
    observer = PrefixCache(client, NS, chunk_tokens=C)
    try:
        tokens = np.arange(4 * C)
        observer.store(tokens, [np.full((2, C, 64), i, np.float32) for i in range(4)])
        # Renewals every 0.5 s (a third of the claim ttl); the pins themselves last 60 s.
        cache = PrefixCache(client, NS, chunk_tokens=C, pin_lease_s=60, claim_ttl_s=1.5)
        hit = cache.load(tokens)
        assert hit.num_chunks == 4 and observer.refcounts(tokens) == [1] * 4
        gone = weakref.ref(cache)
        del hit, cache
        gc.collect()
        assert gone() is None  # collected, its renewal thread's next tick finds it gone
        assert wait_until(lambda: observer.refcounts(tokens) == [0] * 4, 20), observer.refcounts(tokens)
    finally:
        observer.close()
