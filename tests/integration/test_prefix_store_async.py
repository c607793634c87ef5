"""PrefixCache.store_async: a store on the cache's worker threads, so that an engine's request does
not wait for the writes, nor for room that other requests' hits pin (a workload probe, 2026-12-07:
stores of 512 KiB chunks took 4-7 s then)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mooncake_store import Client, InvalidValue, MooncakeError, PrefixCache

C = 16
NS = "store-async/u8/L1/kv1/d1/tp0"


def test_store_async_stores_the_prompt_as_given_at_the_call(client: Client) -> None:
    cache = PrefixCache(client, NS + "/ok", chunk_tokens=C)
    try:
        tokens = list(range(5 * C))
        chunks = [np.full(64 << 10, i, np.uint8) for i in range(5)]
        expected = [c.copy() for c in chunks]
        future = cache.store_async(tokens, chunks)
        tokens.clear()  # the caller reuses its lists for the next request at once
        chunks.clear()
        assert future.result(timeout=30) == 5
        prompt = list(range(5 * C))
        assert cache.match(prompt) == 5 * C
        with cache.load(prompt) as hit:
            for got, want in zip(hit.chunks, expected, strict=True):
                assert np.array_equal(got, want)
        assert cache.store_async(prompt, expected).result(timeout=30) == 0  # stored already
    finally:
        cache.close()


def test_store_async_reports_its_errors_through_the_future(client: Client) -> None:
    cache = PrefixCache(client, NS + "/errors", chunk_tokens=C)
    try:
        future = cache.store_async(list(range(3 * C)), [np.zeros(1024, np.uint8)] * 2)
        with pytest.raises(InvalidValue, match=r"3 chunk\(s\) of 16 tokens to store but 2 chunk array\(s\) given"):
            future.result(timeout=30)
    finally:
        cache.close()
    with pytest.raises(MooncakeError, match="closed"):
        cache.store_async(list(range(C)), [np.zeros(1024, np.uint8)])


def test_a_store_that_waits_holds_no_load_back(client: Client) -> None:
    """Stores and loads shared one pool of io_threads workers (review): two stores waiting for room
    held a load_async back for as long as they waited. A store here waits inside its chunks
    callable, on the worker, until the test lets it go."""
    cache = PrefixCache(client, NS + "/apart", chunk_tokens=C, io_threads=1)
    try:
        stored = list(range(2 * C))
        assert cache.store(stored, [np.full(1024, i, np.uint8) for i in range(2)]) == 2
        release = threading.Event()

        def slow_chunk(i: int) -> np.ndarray:
            release.wait(30)
            return np.full(1024, 50 + i, np.uint8)

        waiting = cache.store_async(list(range(1000, 1000 + 2 * C)), slow_chunk)
        try:
            load = cache.load_async(stored)
            hit = load.result(timeout=10)  # not behind the store
            with hit:
                assert hit.num_chunks == 2
            assert not waiting.done()
        finally:
            release.set()
        assert waiting.result(timeout=30) == 2
    finally:
        cache.close()
