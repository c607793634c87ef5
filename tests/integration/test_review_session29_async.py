"""SDK review (session 29): what the *_async calls take as it is at the call, exceptions that
cross a process boundary, and reprs. put_many_async read chain_pos and chain_parent on its worker
(a key added after the call failed the put), PrefixCache.load_async read the token ids there (a
list reused at once matched another prompt), and DtypeMismatch could not be unpickled: a process
pool whose worker raised it broke."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pytest

import mooncake_store
from mooncake_store import Client, DtypeMismatch, LocalCluster, PrefixCache

MiB = 1 << 20


def _busy_worker(client: Client) -> threading.Event:
    """Holds the client's only worker thread (io_threads=1) until the returned event is set: what
    is submitted meanwhile runs after the caller has gone on."""
    release, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(30)

    client._submit(hold)
    assert started.wait(10)
    return release


def test_put_many_async_takes_the_chain_mappings_as_they_are_at_the_call(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    client = make_client(make_cluster(1), io_threads=1)
    release = _busy_worker(client)
    positions, parents = {"c0": 0, "c1": 1}, {"c1": "c0"}
    future = client.put_many_async({"c0": b"a", "c1": b"b"}, chain_pos=positions, chain_parent=parents)
    positions["zzz"] = 5  # the caller reuses its mappings at once
    parents["zzz"] = "c1"
    release.set()
    future.result(30)
    assert client.get("c1").tobytes() == b"b"


def test_prefix_load_async_takes_the_token_ids_as_they_are_at_the_call(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    client = make_client(make_cluster(1), io_threads=1)
    cache = PrefixCache(client, "rv29-async", chunk_tokens=4, io_threads=1)
    try:
        tokens = list(range(12))
        cache.store(tokens, [np.full(16, i, np.uint8) for i in range(3)])
        release = threading.Event()
        blocker = cache.load_async(tokens, outs=lambda n: (release.wait(30), [bytearray(16) for _ in range(n)])[1])
        future = cache.load_async(tokens)
        tokens[:] = [99] * 12  # the caller reuses its list at once
        release.set()
        blocker.result(30).release()
        with future.result(30) as hit:
            assert hit.num_tokens == 12
    finally:
        cache.close()


def _exceptions() -> list[BaseException]:
    """Each public exception, made as the store makes it."""
    made: list[BaseException] = []
    for name in mooncake_store.__all__:
        cls = getattr(mooncake_store, name)
        if not (isinstance(cls, type) and issubclass(cls, mooncake_store.MooncakeError)):
            continue
        if cls is DtypeMismatch:
            made.append(cls("key 'k' holds <f4 but out has dtype <f8", stored="<f4", out="<f8"))
        else:
            made.append(cls(f"a {name}"))
    return made


@pytest.mark.parametrize("exc", _exceptions(), ids=lambda e: type(e).__name__)
def test_every_public_exception_pickles_with_its_attributes(exc: BaseException) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc) and vars(back) == vars(exc)


def _dtype_mismatch_in_a_worker(redis_url: str, namespace: str) -> Any:
    with mooncake_store.connect(redis_url, namespace=namespace) as client:
        client.get_into("f32", np.empty(4, np.float64))


def test_a_dtype_mismatch_raised_in_a_process_pool_reaches_the_parent(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """It broke the pool (BrokenProcessPool) instead."""
    cluster = make_cluster(1)
    with mooncake_store.connect(cluster.redis_url, namespace=cluster.namespace) as client:
        client.put("f32", np.zeros(4, np.float32))
    import multiprocessing

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        future = pool.submit(_dtype_mismatch_in_a_worker, cluster.redis_url, cluster.namespace)
        with pytest.raises(DtypeMismatch) as caught:
            future.result(120)
    assert (caught.value.stored, caught.value.out) == ("<f4", "<f8")


def test_reprs_say_where_and_whether_closed(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    cache = PrefixCache(client, "rv29-repr", chunk_tokens=4)
    assert repr(client) == f"<Client {cluster.redis_url} namespace={cluster.namespace!r}>"
    assert repr(cache) == f"<PrefixCache {cluster.redis_url} namespace='rv29-repr' chunk_tokens=4>"
    cache.close()
    client.close()
    assert repr(client).endswith(" closed>") and repr(cache).endswith(" closed>")
