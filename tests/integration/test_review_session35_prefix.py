"""The prefix cache's refcounts over a prompt's tail, and stores extending a chain whose last chunk
another writer is storing (review, thirty-fifth session)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from mooncake_store import Client, PrefixCache

pytestmark = pytest.mark.timeout(120)

C = 16  # tokens per chunk
ELEMS = 64  # float32 values per full chunk


def namespace(name: str) -> str:
    return f"session35-{name}-{uuid.uuid4().hex[:8]}/f32/L1/kv1/d8/tp0"


def chunk(i: int, elems: int = ELEMS) -> np.ndarray:
    return np.full(elems, i + 1, np.float32)


def test_refcounts_cover_the_tail_chunk(shared_client: Client) -> None:
    """refcounts() asked of the full chunks only: a pin held (or leaked) on a prompt's stored tail
    did not show, so a check that a load left nothing pinned passed with the tail still pinned."""
    cache = PrefixCache(shared_client, namespace("tail"), chunk_tokens=C)
    try:
        ids = np.arange(2 * C + 4)
        assert cache.store(ids, [chunk(0), chunk(1), chunk(2, 16)], include_tail=True) == 3
        tail_key = cache.keys(ids, include_tail=True)[2]
        with cache.load(ids) as hit:
            assert hit.num_chunks == 3
            assert cache.refcounts(ids) == [1, 1, 1]
        assert cache.refcounts(ids) == [0, 0, 0]
        # A pin on the tail alone (a dead client's, held to its lease) shows, and only there.
        assert cache.index.pin([tail_key], pin_id="leaked", lease_ms=60_000) == [True]
        assert cache.refcounts(ids) == [0, 0, 1]
        assert cache.refcounts(ids, include_tail=False) == [0, 0]
        # The tail's key depends on its tokens: another tail after the same full chunks is not it.
        assert cache.refcounts(np.r_[ids[: 2 * C], [9, 9, 9, 9]]) == [0, 0, 0]
        assert cache.refcounts(ids[: 2 * C]) == [0, 0]  # no tail, no entry for one
        cache.index.unpin([tail_key], pin_id="leaked")
        assert cache.refcounts(ids) == [0, 0, 0]
    finally:
        cache.close()
