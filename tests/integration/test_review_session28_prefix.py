"""Prefix chains under pressure and a cache's life with its client (review, twenty-eighth session)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import Client, ConnectError, LocalCluster, NoCapacity, PrefixCache

pytestmark = pytest.mark.timeout(120)

C = 16  # tokens per chunk
NS = "session28/f32/L1/kv1/d16/tp0"


def chunks_of(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, C, 16)).astype(np.float32) for _ in range(n)]


def chunk(i: int) -> np.ndarray:
    """A 16 KiB chunk of ``i``s: a 16 MiB node holds ~1000, more than a pass samples (256)."""
    return np.full((2, C, 128), i, np.float32)


def one_node_of_small_chunks(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], name: str
) -> tuple[Client, PrefixCache]:
    """One 16 MiB node; a client whose read leases end at once (the chunks may go once read)."""
    cluster = make_cluster(1, host_bytes=16 << 20)
    client = make_client(cluster, lease_ms=20, timeout_s=30)
    return client, PrefixCache(client, f"{NS}/{name}", chunk_tokens=C)


def evict_last_copy(client: Client, key: str) -> str:
    """What a pressure pass does to a leaf chunk (evict.lua, the agent's own call)."""
    replica = client.object_meta(key).replicas[0]
    return client.index.evict(key, node_id=replica.node_id, alloc_id=replica.alloc_id)


def test_a_store_pins_the_stored_chunk_it_extends_until_its_chunks_are_committed(client: Client) -> None:
    """A store extending a stored chain (a's 4 chunks, then b = a + 3 more) claimed b's new chunks,
    and a pressure pass could evict a's last chunk, a leaf until b's chunks hang off it, before
    they were committed: they were committed under a parent that was gone, unreachable by every
    match (3 of 7 chunks matched) while store() said 3 were written. Now that chunk is pinned by
    the store from its claim to its release."""
    cache = PrefixCache(client, NS, chunk_tokens=C)
    a, b = np.arange(4 * C), np.arange(7 * C)
    data = chunks_of(7, seed=1)
    assert cache.store(a, data[:4]) == 4
    evictions: list[str] = []

    def chunk_evicting_the_parent(i: int) -> np.ndarray:
        if i == 4:  # the store's first new chunk: its claim was made, its puts are to come
            evictions.append(evict_last_copy(client, cache.keys(a)[3]))
        return data[i]

    assert cache.store(b, chunk_evicting_the_parent) == 3
    assert evictions == ["PINNED"]
    assert cache.match(b) == 7 * C
    with cache.load(b) as hit:
        for got, want in zip(hit.chunks, data, strict=True):
            np.testing.assert_array_equal(got, want)
    assert cache.refcounts(b) == [0] * 7  # the store's pin went with its claims
    cache.close()


def test_a_parent_evicted_between_the_claim_and_its_pin_is_written_too(client: Client) -> None:
    """The pin follows the claim in a second round trip: a parent evicted in between is found gone
    (the pin says so), and a second claim gives it to this store to write, with the rest."""
    cache = PrefixCache(client, NS + "/gap", chunk_tokens=C)
    a, b = np.arange(3 * C) + 500, np.arange(5 * C) + 500
    data = chunks_of(5, seed=2)
    assert cache.store(a, data[:3]) == 3
    claim = cache.index.claim
    evictions: list[str] = []

    def claim_then_evict(*args: object, **kwargs: object) -> list[str]:
        statuses = claim(*args, **kwargs)  # type: ignore[arg-type]
        if not evictions:
            evictions.append(evict_last_copy(client, cache.keys(a)[2]))
        return statuses

    cache.index.claim = claim_then_evict  # type: ignore[method-assign]
    assert cache.store(b, data) == 3  # chunks 3 and 4, and the parent evicted meanwhile
    assert evictions == ["OK"]
    assert cache.match(b) == 5 * C
    assert cache.refcounts(b) == [0] * 5
    cache.close()


def test_cold_chains_are_cut_back_before_a_hot_prompt_or_the_newest_chunks_go(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """One node, ~1000 chunks of 16 KiB, more than a pass samples (256): 100 cold 9-chunk prompts,
    then a hot one (stored and loaded), then filler chains that take the node past its high
    watermark. A pass skipped the cold chains' early chunks it sampled (stored chunks hang off
    them) and evicted the leaves it had instead, warmer ones: the hot prompt lost up to 6 of its
    9 chunks and the newest filler 13-34 chunks, while cold chains stayed whole. A sampled chunk
    of a cold chain now stands for its chain, which is cut back from its leaves."""
    client, cache = one_node_of_small_chunks(make_cluster, make_client, "lru")
    length = 9
    cold = [np.arange(length * C) + 100_000 * (j + 1) for j in range(100)]
    for j, tokens in enumerate(cold):
        cache.store(tokens, [chunk(j)] * length)
    hot = np.arange(length * C) + 77_000_000
    cache.store(hot, [chunk(999)] * length)
    with cache.load(hot) as hit:
        assert hit.num_chunks == length
    filler = [np.arange(length * C) + 900_000_000 + 10_000 * j for j in range(20)]
    for j, tokens in enumerate(filler):
        cache.store(tokens, [chunk(5000 + j)] * length)
    assert wait_until(lambda: client.stat().evictions > 0, 10)
    time.sleep(1.0)  # the drain's last passes
    assert cache.match(hot) == length * C, "the hot prompt lost chunks"
    assert [cache.match(t) for t in filler] == [length * C] * len(filler), "the newest chunks went"
    assert sum(cache.match(t) < length * C for t in cold) > 0  # what went instead
    with cache.load(hot) as hit:  # the hot prompt's bytes, whole
        for got in hit.chunks:
            np.testing.assert_array_equal(got, chunk(999))
    cache.close()


def test_a_put_that_waited_in_vain_on_a_node_of_held_prompts_says_why(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A node full of chunks that a held hit pins: a put waited timeout_s and failed saying only
    how little was free, nothing of the pins that kept the agent from making room."""
    cluster = make_cluster(1, host_bytes=8 << 20)
    client = make_client(cluster, timeout_s=1, lease_ms=20)  # read leases out of the way once released
    cache = PrefixCache(client, NS + "/held", chunk_tokens=C)
    tokens = np.arange(56 * C)
    # 7 of 8 MiB: under the high watermark (7.2 MiB), so no pass cuts the chain before it is held
    # (at 7.5 MiB one could, between the store and the load, on a loaded machine).
    assert cache.store(tokens, [np.zeros((C, 2048), np.float32)] * 56) == 56
    with cache.load(tokens) as hit:
        assert hit.num_chunks == 56
        with pytest.raises(NoCapacity, match=r"no room came within timeout_s \(1 s\): objects pinned by a held"):
            client.put("big", np.zeros(2 << 20, np.uint8))
    # Released: the chunks may go now. Through a client that waits long enough for a pass and its
    # reclaim on a loaded machine (the first one's 1 s is the retry schedule's ~0.75 s of waits).
    make_client(cluster, timeout_s=10).put("big", np.zeros(2 << 20, np.uint8))
    cache.close()


def test_a_hit_dropped_without_release_is_unpinned_at_the_caches_next_call(client: Client) -> None:
    """A hit dropped unreleased (no ``with``, no release()) kept its chunks pinned for its whole
    lease, 30 s: an engine that forgot one release per request kept much of a node pinned, where
    no pressure pass could move or evict it. The cache now unpins a dropped hit's chunks at its
    next call (and at each renewal, and at close())."""
    cache = PrefixCache(client, NS + "/dropped", chunk_tokens=C)
    tokens = np.arange(3 * C) + 4000
    cache.store(tokens, chunks_of(3, seed=5))
    hit = cache.load(tokens)
    assert cache.refcounts(tokens) == [1, 1, 1]
    del hit
    gc.collect()
    assert cache.match(tokens) == 3 * C  # the next call
    assert cache.refcounts(tokens) == [0, 0, 0]
    kept = cache.load(tokens)  # one released as it should be is unpinned once, and no more
    kept.release()
    del kept
    gc.collect()
    with cache.load(tokens) as held:
        assert cache.refcounts(tokens) == [1, 1, 1]
        assert held.num_chunks == 3
    assert cache.refcounts(tokens) == [0, 0, 0]
    cache.close()


def test_a_store_whose_claim_fails_after_its_pin_landed_leaves_nothing_held(client: Client) -> None:
    """An index call that failed after the store's pin (or claim) had landed left the parent
    pinned and the chunks claimed for the claim's ttl: nobody could remove the parent or write
    the chunks meanwhile."""
    cache = PrefixCache(client, NS + "/claimfail", chunk_tokens=C)
    a, b = np.arange(3 * C) + 7000, np.arange(5 * C) + 7000
    assert cache.store(a, chunks_of(3, seed=6)) == 3
    pin = cache.index.pin

    def pin_then_fail(*args: object, **kwargs: object) -> list[bool]:
        pin(*args, **kwargs)  # type: ignore[arg-type]
        raise ConnectError("the index did not answer (the pin landed)")

    cache.index.pin = pin_then_fail  # type: ignore[method-assign]
    with pytest.raises(ConnectError):
        cache.store(b, chunks_of(5, seed=6))
    cache.index.pin = pin  # type: ignore[method-assign]
    assert cache.refcounts(b) == [0] * 5
    other = PrefixCache(client, NS + "/claimfail", chunk_tokens=C)
    assert other.store(b, chunks_of(5, seed=6)) == 2  # not BUSY: the failed store's claims went
    assert client.remove(cache.keys(a)[0]) is True  # not pinned
    other.close()
    cache.close()


def test_a_prompt_extended_by_a_store_alone_keeps_its_prefix_warm(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Prompt a (4 chunks) stored long ago and never loaded, then b = a + 5 chunks stored (not
    loaded) after 60 other prompts, then 50 more to take the node past its high watermark. The
    chain is cut back by the coldness of its earlier chunks: a's, untouched since its store, were
    the coldest, and b lost 7 of its 9 chunks while older prompts stayed whole. A store now counts
    as an access of the stored chunks it extends. (Also: chain chunks counted at their own size
    made a pass queue warmer leaves than it needed, and the newest prompts lost chunks.)"""
    client, cache = one_node_of_small_chunks(make_cluster, make_client, "extended")
    length = 9
    a, b = np.arange(4 * C) + 3_000_000_000, np.arange(9 * C) + 3_000_000_000
    cache.store(a, [chunk(1)] * 4)
    older = [np.arange(length * C) + 100_000 * (j + 1) for j in range(60)]
    for j, tokens in enumerate(older):
        cache.store(tokens, [chunk(10 + j)] * length)
    assert cache.store(b, [chunk(1)] * 9) == 5
    newer = [np.arange(length * C) + 900_000_000 + 10_000 * j for j in range(50)]
    for j, tokens in enumerate(newer):
        cache.store(tokens, [chunk(500 + j)] * length)
    assert wait_until(lambda: client.stat().evictions > 0, 10)
    time.sleep(1.0)  # the drain's last passes
    assert cache.match(b) == 9 * C, "the extended prompt lost chunks"
    assert [cache.match(t) // C for t in newer] == [length] * len(newer), "the newest prompts lost chunks"
    assert sum(cache.match(t) < length * C for t in older) > 0  # what went instead
    cache.close()


def test_a_hit_dropped_after_a_renewal_is_unpinned_too(client: Client) -> None:
    """The renewal loop's locals held the last tick's hits while it waited for the next: a hit
    dropped after one renewal was never collected, and its pins were renewed until the cache
    closed (review of the dropped-hit change)."""
    cache = PrefixCache(client, NS + "/renewed-drop", chunk_tokens=C, pin_lease_s=0.6, claim_ttl_s=0.6)
    tokens = np.arange(3 * C) + 8000
    cache.store(tokens, chunks_of(3, seed=7))
    hit = cache.load(tokens)
    time.sleep(0.5)  # past a renewal (every 0.2 s)
    del hit

    def unpinned() -> bool:
        """Collected and unpinned by the cache's next call. A renewal tick under way when the hit
        was dropped holds it until the tick ends, so the first call after it may come too early."""
        gc.collect()
        cache.match(tokens)  # the next call
        return cache.refcounts(tokens) == [0, 0, 0]

    assert wait_until(unpinned, 5)
    assert wait_until(lambda: not cache._held, 2)
    cache.close()
