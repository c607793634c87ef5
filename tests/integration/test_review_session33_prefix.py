"""Prefix cache review (thirty-third session): pins left behind at close() and by a failed match
window, a cache dropped without close() kept alive by its own thread, a block hash that is no
UTF-8 text, and too few buffers under max_tokens taken for a stored tail."""

from __future__ import annotations

import gc
import threading
import time
import uuid
import weakref

import numpy as np
import pytest

from mooncake_store import Client, ConnectError, InvalidValue, PrefixCache
from mooncake_store.client.prefix_pins import UNPINS_AT_ONCE
from mooncake_store.index.prefix import PrefixIndex

C = 16


def chunks_of(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, C, 16)).astype(np.float32) for _ in range(n)]


def namespace(what: str) -> str:
    return f"s33-{what}-{uuid.uuid4().hex[:6]}/f32/L1/kv1/d1/tp0"


def test_close_unpins_every_hit_dropped_before_it(client: Client) -> None:
    """A hit dropped without release() is unpinned at close() (README); close() unpinned only
    UNPINS_AT_ONCE of them, and the rest stayed pinned for their lease (600 s here)."""
    cache = PrefixCache(client, namespace("drop-many"), chunk_tokens=C, pin_lease_s=600)
    count = UNPINS_AT_ONCE + 36
    prompts = [np.arange(C) + 1000 * j for j in range(count)]
    for tokens in prompts:
        cache.store(tokens, chunks_of(1, seed=1))
    hits = [cache.load(tokens) for tokens in prompts]  # each load first unpins what was dropped: none yet
    assert all(h.num_chunks == 1 for h in hits)
    del hits
    gc.collect()
    cache.close()
    pinned = sum(cache.refcounts(tokens)[0] for tokens in prompts)
    assert pinned == 0, f"{pinned} of {count} dropped hits still pinned after close()"


def test_a_cache_dropped_without_close_is_collected_and_its_thread_ends(client: Client) -> None:
    """The renewal thread's target was the cache's bound method: a cache dropped without close()
    was never collected, and its thread ran until the client closed, one per cache made."""
    before = {t for t in threading.enumerate() if t.name == "mc-prefix-renew"}
    refs = []
    for j in range(3):
        cache = PrefixCache(client, namespace(f"dropped{j}"), chunk_tokens=C, pin_lease_s=0.3)
        tokens = np.arange(2 * C) + 1000 * j
        cache.store(tokens, chunks_of(2))
        with cache.load(tokens) as hit:
            assert hit.num_chunks == 2
        refs.append(weakref.ref(cache))
        del cache, hit
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (
        any(r() is not None for r in refs) or {t for t in threading.enumerate() if t.name == "mc-prefix-renew"} - before
    ):
        gc.collect()
        time.sleep(0.1)
    assert all(r() is None for r in refs), f"{sum(r() is not None for r in refs)} of 3 dropped caches kept alive"
    alive = {t for t in threading.enumerate() if t.name == "mc-prefix-renew"} - before
    assert not alive, f"{len(alive)} renewal thread(s) outlive their dropped caches"


@pytest.mark.parametrize("call", ["match", "load", "store", "refcounts", "keys"])
def test_a_block_hash_that_is_no_utf8_text_is_an_invalid_value(client: Client, call: str) -> None:
    """A str block hash with a lone surrogate (what bytes.decode(errors="surrogateescape") gives)
    escaped as a UnicodeEncodeError."""
    cache = PrefixCache(client, namespace("surrogate"), chunk_tokens=C)
    hashes = ["ok", "bad\udcff"]
    calls = {
        "match": lambda: cache.match(block_hashes=hashes),
        "load": lambda: cache.load(block_hashes=hashes),
        "store": lambda: cache.store(block_hashes=hashes, chunks=chunks_of(2)),
        "refcounts": lambda: cache.refcounts(block_hashes=hashes),
        "keys": lambda: cache.keys(block_hashes=hashes),
    }
    try:
        with pytest.raises(InvalidValue, match=r"must be UTF-8 text.*surrogates not allowed at 3"):
            calls[call]()
    finally:
        cache.close()


def test_too_few_buffers_under_max_tokens_are_refused_with_or_without_a_tail(client: Client) -> None:
    """With max_tokens cutting a prompt's tail off, the last key is a full chunk; taken for a tail
    that another writer stored, it was unpinned and dropped, a one-chunk hit returned instead of
    the too-few-buffers error a prompt without a tail gets."""
    cache = PrefixCache(client, namespace("outs"), chunk_tokens=C)
    tokens = np.arange(2 * C + 5) + 77_000
    cache.store(tokens, chunks_of(2))
    one = [np.empty((2, C, 16), np.float32)]
    try:
        with pytest.raises(InvalidValue, match="2 chunk"):
            cache.load(tokens[: 2 * C], max_tokens=2 * C, outs=one)
        with pytest.raises(InvalidValue, match="2 chunk"):
            cache.load(tokens, max_tokens=2 * C, outs=one)
        assert cache.refcounts(tokens[: 2 * C]) == [0, 0]  # the refused loads left no pins
    finally:
        cache.close()


def test_a_match_whose_reply_was_lost_leaves_no_pins_behind(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window whose script ran (its chunks pinned) and whose reply was lost (a timeout, a reset)
    raised with those pins left for their whole lease: only the earlier windows' were lifted."""
    cache = PrefixCache(client, namespace("lost-reply"), chunk_tokens=C)
    tokens = np.arange(3 * C)
    cache.store(tokens, chunks_of(3))
    index = PrefixIndex(client.index)
    real_run = index._run

    def reply_lost(name: str, *args: object) -> object:
        result = real_run(name, *args)
        if name == "prefix_match":
            raise ConnectError("the reply was lost (injected)")
        return result

    monkeypatch.setattr(index, "_run", reply_lost)
    try:
        with pytest.raises(ConnectError, match="injected"):
            index.match(cache.keys(tokens), pin_id="s33-pins", lease_ms=60_000)
        assert cache.refcounts(tokens) == [0, 0, 0]
    finally:
        cache.close()
