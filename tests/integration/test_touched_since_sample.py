"""An object accessed after the sample that chose it as a victim is not evicted (a prefix-cache
probe of 2026-12-07): a store's claim touches the chunks it extends and commits the ones it adds,
but grants no read lease, and evict.lua and evict_chains.lua checked pins and leases alone. A pass
that sampled before such a store and evicted after it cut the prompt just stored back from its new
leaves, while some 150 colder chunks stayed. Both scripts now answer TOUCHED for what was
accessed after the sample's time (the pass's own, read before its sample)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mooncake_store import Client, PrefixCache
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

KiB = 1 << 10
C = 4  # tokens per chunk
NS = "touched-model/u8/L1/kv1/d1/tp0"


def _chunks(seed: int, n: int) -> list[np.ndarray]:
    return [np.full(256 * KiB, seed * 16 + i, np.uint8) for i in range(n)]


def _plain_and_a_prompt(agent: Agent, client: Client, cache: PrefixCache) -> list[int]:
    """A plain object ("plain") and a prompt of three chunks, stored and synced: the prompt's ids."""
    client.put("plain", np.zeros(KiB, np.uint8))
    tokens = list(range(3 * C))
    assert cache.store(tokens, _chunks(1, 3)) == 3
    agent.sync_once()
    return tokens


def _alloc_id(client: Client, key: str) -> int:
    meta = client.object_meta(key)
    assert meta is not None
    return meta.replicas[0].alloc_id


def test_the_scripts_refuse_what_was_accessed_after_the_sample(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    agent = direct_agent(namespace)
    client = client_of(namespace)
    cache = PrefixCache(client, NS, chunk_tokens=C)
    try:
        tokens = _plain_and_a_prompt(agent, client, cache)
        index = client.index
        sampled = index.server_time_ms()
        time.sleep(0.01)
        assert index.lookup(["plain"], lease_ms=1).objects[0] is not None  # read: its lease ends at once
        assert cache.store(tokens, _chunks(1, 3)) == 0  # every chunk there: touched, none written
        time.sleep(0.01)  # the read's 1 ms lease is over: LEASED no longer stands in for TOUCHED

        node = agent.node_id
        assert index.evict_many([("plain", _alloc_id(client, "plain"))], node_id=node, since_ms=sampled) == ["TOUCHED"]
        first = cache.keys(tokens)[0]
        freed, evicted, statuses, gone = index.evict_chains(
            [(first, _alloc_id(client, first))],
            node_id=node,
            tier="host",
            wanted_bytes=1,
            most_later=64,
            since_ms=sampled,
        )
        assert (freed, evicted, statuses, gone) == (0, 0, ["TOUCHED"], [])
        assert cache.match(tokens) == 3 * C
        # Judged from after the accesses, they go as before.
        now = index.server_time_ms()
        assert index.evict_many([("plain", _alloc_id(client, "plain"))], node_id=node, since_ms=now) == ["OK"]
        _, evicted, statuses, _ = index.evict_chains(
            [(first, _alloc_id(client, first))], node_id=node, tier="host", wanted_bytes=1, most_later=64, since_ms=now
        )
        assert (evicted, statuses) == (1, ["TRIMMED"])
        assert cache.match(tokens) == 2 * C  # cut back from its leaf only
    finally:
        cache.close()


def test_an_access_in_the_millisecond_of_the_sample_counts_as_touched(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """The index's clock counts milliseconds: a store that followed a pass's sample within the same
    one left its chunks' last access equal to the sample's time, and the scripts, which refused
    only what was accessed after it, cut the prompt just stored back from its new leaves (CI, once
    in some thousand runs). An access in that millisecond may have come after the sample: TOUCHED."""
    agent = direct_agent(namespace)
    client = client_of(namespace)
    cache = PrefixCache(client, NS, chunk_tokens=C)
    try:
        tokens = _plain_and_a_prompt(agent, client, cache)
        index = client.index
        assert index.lookup(["plain"], lease_ms=1).objects[0] is not None
        assert cache.store(tokens, _chunks(1, 3)) == 0  # every chunk touched, none written
        time.sleep(0.01)  # the read's 1 ms lease is over: LEASED no longer stands in for TOUCHED

        def last_access(key: str) -> int:
            return int(index.redis.hget(index.prefix + "o:" + key, "last_access"))

        node = agent.node_id
        at = last_access("plain")
        assert index.evict_many([("plain", _alloc_id(client, "plain"))], node_id=node, since_ms=at) == ["TOUCHED"]
        leaf = cache.keys(tokens)[-1]
        first = cache.keys(tokens)[0]
        at = last_access(leaf)  # the store touched every chunk: the leaf's time stops the chain
        freed, evicted, statuses, gone = index.evict_chains(
            [(first, _alloc_id(client, first))], node_id=node, tier="host", wanted_bytes=1, most_later=64, since_ms=at
        )
        assert (freed, evicted, statuses, gone) == (0, 0, ["TOUCHED"], [])
        assert cache.match(tokens) == 3 * C
        # A millisecond later, the same accesses are older than the sample: they go as before.
        assert index.evict_many(
            [("plain", _alloc_id(client, "plain"))], node_id=node, since_ms=last_access("plain") + 1
        ) == ["OK"]
    finally:
        cache.close()


def test_a_store_between_a_pass_sample_and_its_evictions_keeps_its_prompt_whole(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    agent = direct_agent(namespace)  # 4 MiB host tier, no peers: what goes is evicted
    client = client_of(namespace)
    cache = PrefixCache(client, NS, chunk_tokens=C)
    try:
        stored = list(range(100, 100 + 4 * C))  # the coldest prompt: stored first
        assert cache.store(stored, _chunks(2, 4)) == 4
        others = [list(range(1000 * p, 1000 * p + 4 * C)) for p in (1, 2)]
        for p, tokens in enumerate(others):
            assert cache.store(tokens, _chunks(3 + p, 4)) == 4
        assert cache.store(list(range(5000, 5000 + 3 * C)), _chunks(5, 3)) == 3  # 3.75 MiB of 4 in all
        agent.sync_once()

        sample = agent.index.victim_candidates

        def store_after_the_sample(*args: Any, **kwargs: Any) -> Any:
            # The interleaving of the race: the pass has its sample (the stored prompt coldest of
            # all), then an engine stores that prompt again, touching every chunk of it.
            out = sample(*args, **kwargs)
            assert cache.store(stored, _chunks(2, 4)) == 0
            return out

        agent.index.victim_candidates = store_after_the_sample  # type: ignore[method-assign]
        assert agent.pressure.relieve_host() > 0  # room made all the same, of colder chains
        assert cache.match(stored) == 4 * C
        with cache.load(stored) as hit:
            for got, want in zip(hit.chunks, _chunks(2, 4), strict=True):
                assert np.array_equal(got, want)
        assert agent.pressure.counters[TierKind.HOST]["evictions"] > 0
        assert min(cache.match(tokens) for tokens in others) < 4 * C  # a colder chain was cut instead
    finally:
        cache.close()


def test_a_pass_whose_every_victim_was_read_since_it_began_still_makes_its_room(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """Recency is a preference, not a veto (a regression probe of the change above): refused for
    good, a node whose every object readers touched while a writer waited made its room two to
    three times slower, at the back-off of passes that freed nothing. The accessed victims now go
    once the rest could not make the room; a live lease still keeps one."""
    agent = direct_agent(namespace)
    client = client_of(namespace)
    keys = [f"hot{i}" for i in range(15)]  # 3.75 MiB of 4: past the 3.6 MiB mark
    for i, key in enumerate(keys):
        client.put(key, np.full(256 * KiB, i, np.uint8))
    agent.sync_once()
    sample = agent.index.victim_candidates

    def read_everything_after_the_sample(*args: Any, **kwargs: Any) -> Any:
        out = sample(*args, **kwargs)
        assert all(m is not None for m in client.index.lookup(keys, lease_ms=1).objects)
        time.sleep(0.01)  # their 1 ms leases are over: touched, not leased
        return out

    agent.index.victim_candidates = read_everything_after_the_sample  # type: ignore[method-assign]
    assert agent.pressure.relieve_host() >= 3 * 256 * KiB  # one pass: down to the 3 MiB mark
    assert agent.pressure.counters[TierKind.HOST]["evictions"] == 3
    left = [key for key in keys if client.exists(key)]
    assert left == keys[3:]  # the coldest by the sample went
