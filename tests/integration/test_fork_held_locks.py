"""close() in a forked child, forked while a thread of the parent held one of the client's or
the prefix cache's locks (a submit of an ``*_async`` call holds the client's, a renewal a hit's):
no thread ever releases that lock in the child, and close() took it before it checked for a fork,
so the child hung for good; so did an ``*_async`` call there (a probe: about 1 in 300 forks beside
threads calling them). Each fork here is taken with the lock held, as such a thread would."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from helpers import in_forked_child

from mooncake_store import Client, LocalCluster, MooncakeError, PrefixCache

#: Far above what each child takes (a close that returns at once): only a hang reaches it.
HANG_S = 20.0


def _forked_with(lock: threading.Lock, work: Callable[[], str]) -> str:
    with lock:
        return in_forked_child(work, timeout_s=HANG_S)


def test_client_close_in_a_child_forked_under_the_pool_lock(cluster: LocalCluster, client: Client) -> None:
    client.put("fork/k", b"x" * 64)

    def close() -> str:
        client.close()
        return "closed"

    def new_cache() -> str:  # its constructor asks the client to watch for close (_watch_close)
        PrefixCache(client, "fork-lock", chunk_tokens=4).close()
        return "made and closed"

    assert _forked_with(client._pool_lock, close) == "closed"
    assert _forked_with(client._pool_lock, new_cache) == "made and closed"
    assert bytes(client.get("fork/k")) == b"x" * 64  # the parent's client is whole


def test_cache_close_and_release_in_a_child_forked_under_their_locks(cluster: LocalCluster, client: Client) -> None:
    with PrefixCache(client, "fork-lock", chunk_tokens=4) as cache:
        tokens = list(range(8))
        cache.store(tokens, [np.full(64, 1, dtype=np.uint8)] * 2)
        with cache.load(tokens) as hit:

            def close() -> str:
                cache.close()
                return "closed"

            def release() -> str:
                hit.release()
                return "released"

            assert _forked_with(cache._lock, close) == "closed"
            assert _forked_with(hit._pin_lock, release) == "released"
            assert cache.refcounts(tokens) == [1, 1]  # still the parent's pins
        assert cache.refcounts(tokens) == [0, 0]


def refused(call: Callable[[], object]) -> Callable[[], str]:
    def work() -> str:
        try:
            call()
        except MooncakeError as exc:
            return f"refused: {exc}"
        return "ran"

    return work


def test_async_calls_in_a_child_forked_under_the_submit_locks_are_refused(
    cluster: LocalCluster, client: Client
) -> None:
    client.put("fork/async", b"y" * 64)
    told = _forked_with(client._pool_lock, refused(lambda: client.get_async("fork/async")))
    assert told.startswith("refused: this client was connected in process"), told
    with PrefixCache(client, "fork-async", chunk_tokens=4) as cache:
        told = _forked_with(cache._lock, refused(lambda: cache.load_async(list(range(8)))))
        assert told.startswith("refused: this client was connected in process"), told
    assert bytes(client.get_async("fork/async").result(timeout=30)) == b"y" * 64  # the parent's works
