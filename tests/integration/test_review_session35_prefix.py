"""The prefix cache's refcounts over a prompt's tail, and stores extending a chain whose last chunk
another writer is storing (review, thirty-fifth session)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import Client, LocalCluster, MooncakeError, PrefixCache

pytestmark = pytest.mark.timeout(120)

C = 16  # tokens per chunk
ELEMS = 64  # float32 values per full chunk


def namespace(name: str) -> str:
    return f"session35-{name}-{uuid.uuid4().hex[:8]}/f32/L1/kv1/d8/tp0"


def chunk(i: int, elems: int = ELEMS) -> np.ndarray:
    return np.full(elems, i + 1, np.float32)


def evict_last_copy(client: Client, key: str) -> str:
    """What a pressure pass does to a leaf chunk (evict.lua, the agent's own call)."""
    meta = client.object_meta(key)
    assert meta is not None, key
    replica = meta.replicas[0]
    return client.index.evict(key, node_id=replica.node_id, alloc_id=replica.alloc_id)


def claimed(client: Client, key: str) -> bool:
    return bool(client.index.redis.exists(client.index.prefix + "claim:" + key))


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


def test_a_store_after_a_busy_chunk_waits_for_it_and_pins_it(shared_client: Client) -> None:
    """a (3 chunks) is stored; another writer claims b's chunk 3 (BUSY to this store), and this
    store of b claims chunk 4, whose parent is that chunk. It pinned no parent (a BUSY one cannot
    be pinned): the other writer committed chunk 3, a pressure pass evicted it (a leaf until chunk
    4 hangs off it), and chunk 4 was committed under a parent that was gone: store() said 1, every
    match stopped at 3 chunks, and chunk 4 took space unreachable. The store now waits for the
    other writer's chunk and pins it before it writes its own."""
    client = shared_client
    cache = PrefixCache(client, namespace("busy"), chunk_tokens=C)
    a, b = np.arange(3 * C), np.arange(5 * C)
    keys = cache.keys(b)
    try:
        assert cache.store(a, [chunk(i) for i in range(3)]) == 3
        assert cache.index.claim(keys[3:4], writer_id="other", ttl_ms=60_000) == ["MINE"]
        committed = threading.Event()

        def other_writer() -> None:
            # Once this store has claimed its chunk, the other writer's chunk lands.
            if wait_until(lambda: claimed(client, keys[4]), 20, interval_s=0.005):
                client.put_many({keys[3]: chunk(3)}, chain_pos={keys[3]: 3}, chain_parent={keys[3]: keys[2]})
                cache.index.release(keys[3:4], writer_id="other")
            committed.set()

        evictions: list[str] = []

        def chunk_after_the_others(i: int) -> np.ndarray:
            assert i == 4, i
            assert committed.wait(20)
            evictions.append(evict_last_copy(client, keys[3]))  # its children are still to come
            return chunk(4)

        writer = threading.Thread(target=other_writer)
        writer.start()
        try:
            assert cache.store(b, chunk_after_the_others) == 1
        finally:
            writer.join(30)
        assert evictions == ["PINNED"], "the chunk this store extends was evicted before its child was committed"
        assert cache.match(b) == 5 * C
        with cache.load(b) as hit:
            assert [c.tolist()[0] for c in hit.chunks] == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert cache.refcounts(b) == [0] * 5  # the store's pin went with its claims
    finally:
        cache.close()


def test_a_store_writes_a_busy_chunk_whose_writer_gave_up(shared_client: Client) -> None:
    """The other writer claimed chunk 3 and died: its claim runs out by its ttl. The store committed
    chunk 4 under the missing chunk 3 at once (unreachable until a later store of the prompt); it
    now waits out the claim, then claims and writes chunk 3 itself."""
    cache = PrefixCache(shared_client, namespace("dead"), chunk_tokens=C)
    a, b = np.arange(3 * C) + 1000, np.arange(5 * C) + 1000
    keys = cache.keys(b)
    try:
        assert cache.store(a, [chunk(i) for i in range(3)]) == 3
        assert cache.index.claim(keys[3:4], writer_id="dead", ttl_ms=1500) == ["MINE"]
        assert cache.store(b, [chunk(i) for i in range(5)]) == 2  # chunks 3 and 4
        assert cache.match(b) == 5 * C
        assert cache.refcounts(b) == [0] * 5
    finally:
        cache.close()


def test_a_store_leaves_the_chunks_after_a_chunk_still_busy_at_its_timeout(
    shared_cluster: LocalCluster, make_client: Callable[..., Client]
) -> None:
    """The other writer is stalled (its claim renewed) past this client's timeout_s: the store
    writes nothing that would hang off its chunk, and lets go of those claims, instead of
    committing chunks under a parent that may never come."""
    client = make_client(shared_cluster, timeout_s=1.5)
    cache = PrefixCache(client, namespace("stalled"), chunk_tokens=C)
    a, b = np.arange(3 * C) + 2000, np.arange(6 * C) + 2000
    keys = cache.keys(b)
    try:
        assert cache.store(a, [chunk(i) for i in range(3)]) == 3
        assert cache.index.claim(keys[3:4], writer_id="stalled", ttl_ms=60_000) == ["MINE"]
        assert cache.store(b, [chunk(i) for i in range(6)]) == 0
        assert [client.exists(k) for k in keys[3:]] == [False, False, False]
        assert not claimed(client, keys[4]) and not claimed(client, keys[5])  # released, not held
        assert cache.refcounts(b) == [0] * 6
        cache.index.release(keys[3:4], writer_id="stalled")
        assert cache.store(b, [chunk(i) for i in range(6)]) == 3  # the next store of the prompt
        assert cache.match(b) == 6 * C
    finally:
        cache.close()


def test_close_ends_a_store_waiting_for_a_busy_chunk(shared_client: Client) -> None:
    """The wait for another writer's chunk ends with the cache's close(), as its transfers do, and
    the waiting store's claims go back (they held off every other writer of those chunks)."""
    client = shared_client
    cache = PrefixCache(client, namespace("close"), chunk_tokens=C)
    a, b = np.arange(3 * C) + 3000, np.arange(5 * C) + 3000
    keys = cache.keys(b)
    assert cache.store(a, [chunk(i) for i in range(3)]) == 3
    assert cache.index.claim(keys[3:4], writer_id="stalled", ttl_ms=60_000) == ["MINE"]
    errors: list[BaseException] = []

    def store() -> None:
        try:
            cache.store(b, [chunk(i) for i in range(5)])
        except MooncakeError as exc:
            errors.append(exc)

    storing = threading.Thread(target=store)
    storing.start()
    try:
        assert wait_until(lambda: claimed(client, keys[4]), 10, interval_s=0.005)
        cache.close()
        storing.join(10)
        assert not storing.is_alive()
    finally:
        cache.close()
        storing.join(10)
    assert [str(e) for e in errors] == ["PrefixCache is closed"]
    assert not claimed(client, keys[4])
    cache.index.release(keys[3:4], writer_id="stalled")


def test_two_stores_of_a_prompt_do_not_wait_on_each_other(
    shared_cluster: LocalCluster, make_client: Callable[..., Client], caplog: pytest.LogCaptureFixture
) -> None:
    """A writer that claimed chunk 1 died. Store A of the prompt claims chunks 0 and 2 and waits for
    chunk 1; the dead writer's claim runs out, and store D of the prompt claims chunk 1 before A's
    next poll, then waits for chunk 0, which A held unwritten while it waited. Each waited for the
    other until its timeout_s ran out and gave up what hung off the other's chunk. A store lets
    go of the chunks it claimed ahead of its wait while the wait lasts: D writes them, and A the
    rest."""
    a = PrefixCache(make_client(shared_cluster, timeout_s=4.0), namespace("mutual"), chunk_tokens=C)
    d = PrefixCache(make_client(shared_cluster, timeout_s=4.0), a.namespace, chunk_tokens=C)
    ids = np.arange(3 * C) + 4000
    chunks = [chunk(i) for i in range(3)]
    keys = a.keys(ids)
    assert a.index.claim(keys[1:2], writer_id="dead-writer", ttl_ms=300) == ["MINE"]
    wrote: dict[str, int] = {}
    d_store = threading.Thread(target=lambda: wrote.__setitem__("d", d.store(ids, chunks)))
    real_sleep = a._sleep_open

    def then_the_second_store(seconds: float) -> None:
        # A's first poll comes once the dead writer's claim ran out and D claimed chunk 1.
        if not d_store.is_alive() and "d" not in wrote:
            wait_until(lambda: not claimed(a.client, keys[1]), 5)
            d_store.start()
            wait_until(lambda: claimed(a.client, keys[1]), 5)
        real_sleep(seconds)

    a._sleep_open = then_the_second_store  # type: ignore[method-assign]
    try:
        with caplog.at_level("INFO", logger="mooncake.client"):
            wrote["a"] = a.store(ids, chunks)
            d_store.join(30)
        assert not d_store.is_alive()
        assert wrote["a"] + wrote["d"] == 3, wrote
        assert "not written: their parent is still being stored" not in caplog.text, caplog.text
        assert a.match(ids) == 3 * C
        assert a.refcounts(ids) == [0, 0, 0]
    finally:
        a.close()
        d.close()
