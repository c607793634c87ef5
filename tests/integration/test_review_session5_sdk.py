"""Review of the Python SDK's input checks and life cycle (session 5).

Every test drives the real Client / PrefixCache / transformers adapter against the session's real
Redis-compatible server and real agent processes (LocalCluster); nothing under review is stubbed.
Each test names the bug it catches; all of them fail on the code they were written against.
"""

from __future__ import annotations

import array
import ctypes
import pickle
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from helpers import assert_a_second_close_waits_for_the_first

from mooncake_store import (
    Client,
    ConfigError,
    InvalidKey,
    InvalidValue,
    LocalCluster,
    MooncakeError,
    PrefixCache,
    connect,
)
from mooncake_store.embedded import EmbeddedServer

MiB = 1 << 20


# ---- keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["a\x85b", "red\x9b31m", "x\x80"], ids=["NEL", "CSI", "PAD"])
def test_c1_control_characters_in_a_key_are_invalid_key(shared_client: Client, key: str) -> None:
    """README: keys are UTF-8 text "without control characters". U+0080..U+009F are control
    characters (Unicode category Cc; U+0085 is a line break to str.splitlines, U+009B is the 8-bit
    CSI escape), yet check_key only refuses < U+0020 and U+007F, so these keys are stored."""
    try:
        with pytest.raises(InvalidKey, match="control character"):
            shared_client.put(key, b"x")
    finally:
        try:
            shared_client.remove(key)
        except MooncakeError:
            pass


def test_a_str_where_a_list_of_keys_is_expected_is_refused_not_split_into_characters(
    shared_client: Client,
) -> None:
    """remove_many("äöü") removes the three keys "ä", "ö" and "ü" (a str is a Sequence[str]), and
    get_many("äöü") reads them: a single key passed by mistake deletes other objects."""
    for key in "äöü":
        shared_client.put(key, key.encode())
    try:
        with pytest.raises((InvalidKey, InvalidValue)):
            shared_client.remove_many("äöü")
        assert all(shared_client.exists(k) for k in "äöü"), "remove_many('äöü') removed 'ä', 'ö' and 'ü'"
        with pytest.raises((InvalidKey, InvalidValue)):
            shared_client.get_many("äöü")
    finally:
        for key in "äöü":
            shared_client.remove(key)


def test_put_many_of_a_list_of_pairs_is_invalid_value_not_attribute_error(shared_client: Client) -> None:
    """put_many([("k", b"x")]) dies with AttributeError: 'list' object has no attribute 'items'."""
    with pytest.raises(InvalidValue, match="list"):
        shared_client.put_many([("s5-pairs", b"x")])  # type: ignore[arg-type]


# ---- values ------------------------------------------------------------------------------------


def _ctypes_pointers() -> object:
    return (ctypes.c_void_p * 2)()


@pytest.mark.parametrize(
    "make_value",
    [
        lambda: torch.zeros(8, dtype=torch.float8_e4m3fn),
        lambda: torch.zeros(4, dtype=torch.complex64).conj(),
        lambda: memoryview(array.array("Q", [1, 2])).cast("B").cast("P"),
        _ctypes_pointers,
    ],
    ids=["torch-float8", "torch-conj-view", "memoryview-format-P", "ctypes-pointer-array"],
)
def test_unstorable_buffers_are_invalid_value_not_a_raw_error(shared_client: Client, make_value: Callable) -> None:
    """as_source lets torch's and numpy's own errors through: an fp8 KV tensor (vLLM's
    kv_cache_dtype=fp8) raises TypeError 'Got unsupported ScalarType Float8_e4m3fn', a conjugate
    view RuntimeError, a buffer whose PEP 3118 format numpy cannot read ValueError. DESIGN §3.6:
    a MooncakeError (InvalidValue) that names the dtype/format."""
    with pytest.raises(InvalidValue):
        shared_client.put("s5-unstorable", make_value())
    assert not shared_client.exists("s5-unstorable")


def test_get_into_a_float8_tensor_is_invalid_value_not_type_error(shared_client: Client) -> None:
    shared_client.put("s5-f8-src", np.zeros(8, np.uint8))
    try:
        with pytest.raises(InvalidValue):
            shared_client.get_into("s5-f8-src", torch.zeros(8, dtype=torch.float8_e4m3fn))
    finally:
        shared_client.remove("s5-f8-src")


def test_replicas_true_is_refused_like_every_other_bool_count(shared_client: Client) -> None:
    """replicas=True passes `isinstance(replicas, int)` and stores one replica; the config, the
    prefix cache's seconds and max_tokens all refuse bools."""
    with pytest.raises(InvalidValue, match="replicas"):
        shared_client.put("s5-bool-replicas", b"x", replicas=True)
    assert not shared_client.exists("s5-bool-replicas")


# ---- chain_pos / chain_parent (public put_many arguments) -----------------------------------------


@pytest.fixture(scope="module")
def own_client(redis_server: EmbeddedServer) -> Iterator[Client]:
    """A cluster of this module's own: a stored bad chain_pos poisons its agent's eviction, which
    must not reach the session's shared cluster."""
    with LocalCluster(1, redis_url=redis_server.url, host_bytes=16 * MiB) as cluster:
        client = connect(cluster.redis_url, namespace=cluster.namespace)
        try:
            yield client
        finally:
            client.close()


@pytest.mark.parametrize("chain_pos", [True, 1.5, "3", 2**70, [1]], ids=["bool", "float", "str", "2**70", "list"])
def test_bad_chain_pos_is_invalid_value_and_stores_nothing(own_client: Client, chain_pos: object) -> None:
    """chain_pos is never checked. True or [1] make put_commit.lua fail half-way: put_many raises
    a bare MooncakeError ('index script put_commit failed ... Command arguments must be strings or
    integers') yet the object record was already written COMPLETE, so exists() is True while the
    key is missing from the namespace's key set (ls and stat never see it). 1.5, "3" and 2**70
    are stored as they are ("1.5", "1.1805916207174e+21")."""
    key = f"s5-cp-{type(chain_pos).__name__}-{id(chain_pos) % 1000}"
    try:
        with pytest.raises(InvalidValue, match="chain_pos"):
            own_client.put_many({key: b"x" * 100}, chain_pos={key: chain_pos})  # type: ignore[dict-item]
        assert not own_client.exists(key)
    finally:
        own_client.index.redis.delete(own_client.index.prefix + "o:" + key)
        own_client.remove(key)


@pytest.mark.parametrize("parent", [b"parent", "a\nb", "\ud800", 5], ids=["bytes", "newline", "surrogate", "int"])
def test_bad_chain_parent_is_refused_as_a_bad_key(own_client: Client, parent: object) -> None:
    """chain_parent values are not check_key()ed: bytes die in json.dumps (TypeError), a lone
    surrogate in the Lua script (a bare MooncakeError after the reservation), and "a\\nb" or 5 are
    stored as the parent of a chain, a key no put could ever have."""
    key = f"s5-cpar-{type(parent).__name__}"
    try:
        with pytest.raises((InvalidKey, InvalidValue)):
            own_client.put_many({key: b"x"}, chain_parent={key: parent})  # type: ignore[dict-item]
        assert not own_client.exists(key)
    finally:
        own_client.remove(key)


def test_a_fractional_chain_pos_does_not_kill_the_agents_eviction(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """chain_pos=1.5 is stored as "1.5"; victims.lua hands it back and RedisIndex.victim_candidates
    does int("1.5"): ValueError, which PressureManager.run (it catches only MooncakeError) does not
    survive. The agent never evicts again, so a node that kept taking puts by evicting cold
    objects now refuses them with NoCapacity. Without the poisoned object all 24 puts succeed."""
    cluster = make_cluster(1, host_bytes=8 * MiB)
    client = make_client(cluster, timeout_s=3.0)
    try:
        client.put_many({"poison": b"x" * 100}, chain_pos={"poison": 1.5})  # type: ignore[dict-item]
    except InvalidValue:
        pass  # refused up front: the fix
    for i in range(24):  # 24 MiB through an 8 MiB arena: only eviction makes room
        client.put(f"fill-{i}", np.full(MiB, i, np.uint8))
    assert cluster.agents[0].alive()


# ---- PrefixCache arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"namespace": "model\ud800"},
        {"io_threads": 0},
        {"replicas": 0},
        {"replicas": 17},
        {"chunk_tokens": True},
    ],
    ids=["ns-surrogate", "io_threads-0", "replicas-0", "replicas-17", "chunk_tokens-bool"],
)
def test_prefix_cache_refuses_bad_arguments_at_construction(shared_client: Client, kwargs: dict) -> None:
    """A surrogate in the namespace escapes check_namespace as UnicodeEncodeError (it encodes with
    errors='strict' outside its try); io_threads and replicas are not checked at all (io_threads=0
    surfaces as ThreadPoolExecutor's ValueError on the first load_async, replicas=0 only at the
    first store that writes); chunk_tokens=True is taken as 1."""
    args = {"namespace": "s5-model", "chunk_tokens": 4, **kwargs}
    with pytest.raises(InvalidValue):
        PrefixCache(shared_client, **args).close()


@pytest.mark.parametrize("block_hashes", [b"\x01\x02\x03", "abc"], ids=["bytes", "str"])
def test_a_single_block_hash_is_not_split_into_one_chunk_per_byte(shared_client: Client, block_hashes: object) -> None:
    """block_hashes=b'...' (one engine digest passed by mistake) becomes one chunk per byte, each
    hashed as the int of that byte; "abc" one chunk per character. Both silently name chunks no
    engine meant, instead of InvalidValue asking for a sequence of hashes."""
    with PrefixCache(shared_client, "s5-bh", chunk_tokens=4) as cache, pytest.raises(InvalidValue):
        cache.keys(block_hashes=block_hashes)  # type: ignore[arg-type]


# ---- connect / Client construction --------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kwargs"),
    [("REDIS", {"namespace": None}), ("REDIS", {"namespace": 5}), (None, {}), (5, {})],
    ids=["namespace-None", "namespace-int", "url-None", "url-int"],
)
def test_client_constructor_refuses_bad_arguments_with_a_mooncake_error(
    redis_url: str, url: object, kwargs: dict
) -> None:
    """Client is public (mooncake_store.Client): Client(url, namespace=None) raises TypeError from
    re.match, Client(None) AttributeError ('NoneType' object has no attribute 'startswith')."""
    with pytest.raises(MooncakeError):
        Client(redis_url if url == "REDIS" else url, **kwargs).close()  # type: ignore[arg-type]


def test_a_redis_url_with_port_0_is_refused_not_sent_to_6379() -> None:
    """redis://127.0.0.1:0 passes the URL check (port 0 is "in range"), and redis-py takes a falsy
    port as its default: the client dials 127.0.0.1:6379, a server the URL never named."""
    with pytest.raises(ConfigError, match="port"):
        connect("redis://127.0.0.1:0/0", timeout_s=1.0).close()


def test_pickling_a_client_says_to_connect_in_each_process(shared_client: Client) -> None:
    """pickle.dumps(client) (multiprocessing, Ray, a DataLoader worker) fails deep inside with
    "cannot pickle '_thread.RLock' object"; it should say what to do instead."""
    with pytest.raises(TypeError, match="connect") as caught:
        pickle.dumps(shared_client)
    assert isinstance(caught.value, MooncakeError)  # as every error the store raises


# ---- life cycle -----------------------------------------------------------------------------------


def test_close_from_a_callback_of_the_clients_own_future_closes_everything(shared_cluster: LocalCluster) -> None:
    """close() from a done-callback of get_async runs on the client's own pool thread, and
    pool.shutdown(wait=True) joins that very thread: RuntimeError('cannot join current thread').
    _closed is already True by then, so the TCP connections, shm mappings and Redis pool are never
    closed, and a second close() returns at once."""
    with connect(shared_cluster.redis_url, namespace=shared_cluster.namespace) as setup:
        setup.put("s5-cb", np.zeros(16 * MiB, np.uint8))
    try:
        for _ in range(5):
            client = connect(shared_cluster.redis_url, namespace=shared_cluster.namespace, transports=("tcp",))
            ran_on: list[str] = []
            errors: list[BaseException] = []
            done = threading.Event()

            def close_on_done(
                _fut: object,
                client: Client = client,
                ran_on: list = ran_on,
                errors: list = errors,
                done: threading.Event = done,
            ) -> None:
                ran_on.append(threading.current_thread().name)
                try:
                    client.close()
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    done.set()

            client.get_async("s5-cb").add_done_callback(close_on_done)  # 16 MiB over TCP: still running
            assert done.wait(30)
            if ran_on[0].startswith("mc-io"):
                break
            # The read finished before the callback was added: it ran here; try again.
        else:
            pytest.fail("the get never outlasted add_done_callback")
        assert not errors, f"close() from the client's own future: {errors[0]!r}"
        assert client._tcp._peers == {}, "TCP connections left open by close()"
    finally:
        with connect(shared_cluster.redis_url, namespace=shared_cluster.namespace) as cleanup:
            cleanup.remove("s5-cb")


def test_close_while_other_threads_transfer_raises_only_closed_and_leaves_nothing_open(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """Operations already past _check_open when close() runs carry on against closed transports:
    a striped TCP transfer submits to the closed stripe pool (raw RuntimeError 'cannot schedule new
    futures after shutdown'), and a retry or the next shm copy reopens TCP connections and shm
    mappings that nothing closes any more."""
    cluster = make_cluster(2, host_bytes=64 * MiB)
    results: dict[str, int] = {}
    leaks: list[str] = []
    value = np.zeros(8 * MiB, np.uint8)
    for transports in (("tcp",), ("shm", "tcp")):
        client = connect(cluster.redis_url, namespace=cluster.namespace, transports=transports, stripe_bytes=MiB)
        client.put("s5-big", value)
        stop = threading.Event()
        lock = threading.Lock()

        def loop(op: int, client: Client = client, stop: threading.Event = stop, lock: threading.Lock = lock) -> None:
            while not stop.is_set():
                try:
                    if op == 0:
                        client.get("s5-big")
                    else:
                        client.put(f"s5-w-{threading.get_ident() % 997}", value)
                    outcome = "ok"
                except MooncakeError as exc:
                    outcome = f"{type(exc).__name__}: closed" if "closed" in str(exc) else "MooncakeError"
                except Exception as exc:
                    outcome = f"RAW {type(exc).__name__}: {exc}"
                with lock:
                    results[outcome] = results.get(outcome, 0) + 1

        threads = [threading.Thread(target=loop, args=(i % 2,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.6)
        client.close()
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        if client._tcp._peers:
            leaks.append(f"{transports}: TCP peers reopened after close: {sorted(client._tcp._peers)}")
        if client._shm._segments:
            leaks.append(f"{transports}: shm segments mapped after close: {sorted(client._shm._segments)}")
        with connect(cluster.redis_url, namespace=cluster.namespace) as cleanup:
            cleanup.remove("s5-big")
    raw = {k: n for k, n in results.items() if k.startswith("RAW")}
    assert not raw and not leaks, f"raw errors {raw}; {leaks}"
    # The race was run: transfers were under way when close() came, and ended saying so.
    assert any("closed" in k for k in results) and results.get("ok", 0) > 0, results


# ---- transformers -------------------------------------------------------------------------------


def test_load_prefix_with_a_config_never_restores_kv_of_another_dtype_as_garbage(
    shared_client: Client,
) -> None:
    """load_prefix(cache, ids, config=cfg) stages chunks as float32 (its default dtype) whatever
    dtype was saved; get_into takes a buffer larger than the object and writes raw bytes, so a
    float16 KV cache comes back as float32 tensors of reinterpreted bytes, silently. It must
    restore the saved values (or raise InvalidValue naming both dtypes)."""
    from transformers import LlamaConfig

    from mooncake_store.integrations.transformers import kv_layout, load_prefix, save_prefix

    cfg = LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=64,
        vocab_size=100,
    )
    layers, kv_heads, head_dim = kv_layout(cfg)
    gen = torch.Generator().manual_seed(0)
    past = tuple(
        (
            torch.randn(1, kv_heads, 9, head_dim, generator=gen, dtype=torch.float32).to(torch.float16),
            torch.randn(1, kv_heads, 9, head_dim, generator=gen, dtype=torch.float32).to(torch.float16),
        )
        for _ in range(layers)
    )
    ids = torch.arange(9)
    with PrefixCache(shared_client, "s5-tiny/float16/L2/kv2/d16/tp0", chunk_tokens=4) as cache:
        try:
            assert save_prefix(cache, ids, past) == 2
            try:
                n, restored = load_prefix(cache, ids, config=cfg)
            except InvalidValue:
                return  # refusing the mismatch is fine too
            assert n == 8
            got = restored.layers[0].keys.float()
            want = past[0][0][:, :, :8].float()
            assert torch.equal(got, want), (
                f"restored KV differs from the saved one by {float((got - want).abs().max())}"
            )
        finally:
            shared_client.remove_many(cache.keys(ids))


def test_a_second_close_returns_only_once_the_first_has_closed_everything(
    shared_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() promises that, once it returns, no commit starts and none is under way; a second
    close() from another thread returned at once while the first still waited for puts in flight.
    The first is held in that wait here (a wrapper around its drain waits on an event)."""
    client = connect(shared_cluster.redis_url, namespace=shared_cluster.namespace)
    assert_a_second_close_waits_for_the_first(client.close, client._in_flight, monkeypatch)


def test_calls_whose_index_round_trip_close_cut_short_say_the_client_is_closed(
    shared_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() in another thread while exists/object_meta/remove/stat/match wait on the index:
    the connection closed under them and they raised ConnectError ("the index client ... is
    closed"), which reads as a network fault worth retrying. The close is placed inside each
    call's round trip by a wrapper that runs it there, on another thread, then the real call."""
    from mooncake_store.client.prefix import PrefixCache

    calls: dict[str, Callable[[Client], object]] = {
        "exists": lambda c: c.exists("k"),
        "object_meta": lambda c: c.object_meta("k"),
        "remove": lambda c: c.remove("k"),
        "stat": lambda c: c.stat(),
        "match": lambda c: PrefixCache(c, "cut/u8/L1/kv1/d8/tp0", chunk_tokens=4).match(list(range(8))),
    }
    for name, call in calls.items():
        client = connect(shared_cluster.redis_url, namespace=shared_cluster.namespace)
        client.stat()  # its node table and connections exist: the call's next round trip is cut
        for method in ("lookup", "remove", "counts", "nodes", "_run"):
            real = getattr(client.index, method, None)
            if real is None:
                continue

            def closing_first(
                *args: object, _real: Callable[..., object] = real, _client: Client = client, **kwargs: object
            ) -> object:
                closer = threading.Thread(target=_client.close)
                closer.start()
                closer.join(30)
                return _real(*args, **kwargs)

            monkeypatch.setattr(client.index, method, closing_first)
        with pytest.raises(MooncakeError) as info:
            call(client)
        assert type(info.value) is MooncakeError and str(info.value) == "client is closed", (name, info.value)
        monkeypatch.undo()
