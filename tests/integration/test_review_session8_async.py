"""Review session 8: the SDK's asynchronous and batch API (put_async, get_async, get_into_async,
put_many, get_many, get_many_into, remove_many, PrefixCache.load_async) and its handling of bad
input, against a real index server and real agent subprocesses.

Each test asserts the behaviour the README and the docstrings promise; a failing test shows a
defect. Tests that pass guard behaviour worth keeping.
"""

from __future__ import annotations

import array
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import xxhash
from helpers import requests_waiting_at, stop_process, wait_until

from mooncake_store import MAX_KEY_BYTES, Client, InvalidKey, InvalidValue, LocalCluster, MooncakeError, connect
from mooncake_store.client.prefix import PrefixCache
from mooncake_store.errors import ObjectPinned
from mooncake_store.index.prefix import PrefixIndex

MiB = 1 << 20


def _key(tag: str) -> str:
    return f"rv8-{tag}-{uuid.uuid4().hex[:8]}"


def _classify(exc: BaseException | None) -> str:
    """'ok', 'mooncake' or 'RAW <type>: <message>' for an outcome."""
    if exc is None:
        return "ok"
    if isinstance(exc, MooncakeError):
        return "mooncake"
    return f"RAW {type(exc).__name__}: {exc}"


def _race_close(
    submits: list[Callable[[], Future[Any]]], close: Callable[[], None], outcomes: dict[str, int], max_calls: int
) -> list[Future[Any]]:
    """One thread per ``submits`` entry calls it over and over (at most ``max_calls`` times) while
    ``close`` runs 20 ms in; each thread stops at its first call that raised. Every outcome is
    counted by _classify's kind ('ok', 'mooncake', 'RAW <type>'); returns the futures accepted."""
    stop = threading.Event()
    lock = threading.Lock()
    futures: list[Future[Any]] = []

    def spam(submit: Callable[[], Future[Any]]) -> None:
        for _ in range(max_calls):
            if stop.is_set():
                return
            try:
                futures.append(submit())
                outcome = "ok"
            except BaseException as exc:
                outcome = _classify(exc).split(":")[0]
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if outcome != "ok":
                return

    threads = [threading.Thread(target=spam, args=(submit,)) for submit in submits]
    for th in threads:
        th.start()
    time.sleep(0.02)
    close()
    stop.set()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads), "a submitting thread hung after close()"
    return futures


@pytest.fixture
def one_agent(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster(1, host_bytes=32 * MiB)


@pytest.fixture
def stopped_agent(one_agent: LocalCluster) -> Iterator[Callable[[], None]]:
    """A callable that SIGSTOPs the cluster's only agent (a stalled peer); it is always SIGCONTed
    at the end, by its PID, so the cluster fixture can stop it."""
    pid = one_agent.agents[0].pid
    stopped: list[bool] = []

    def stop() -> None:
        stop_process(pid)  # every thread stopped: the requests sent from here on wait unread
        stopped.append(True)

    yield stop
    if stopped:
        os.kill(pid, signal.SIGCONT)


# ---- close() against operations in flight ---------------------------------------------------------


def test_async_calls_racing_close_get_a_mooncake_error_not_a_raw_runtime_error(one_agent: LocalCluster) -> None:
    """Client._submit checks _closed outside _pool_lock and then submits to self._pool under it;
    close() sets _closed under the lock but shuts the pool down after releasing it. A get_async or
    put_async that passed the check while close() ran (any thread already inside _submit, or
    waiting for the lock) then calls submit() on a shut-down pool: a raw RuntimeError('cannot
    schedule new futures after shutdown') instead of MooncakeError('client is closed')
    (DESIGN.md invariant 6; README: operations under way end with MooncakeError)."""
    with connect(one_agent.redis_url, namespace=one_agent.namespace) as setup:
        setup.put("rv8-race", b"abc")
    outcomes: dict[str, int] = {}
    deadline = time.monotonic() + 15
    for trial in range(12):
        if time.monotonic() > deadline:
            break
        client = connect(one_agent.redis_url, namespace=one_agent.namespace)

        def get(client: Client = client) -> Future[Any]:
            return client.get_async("rv8-race")

        def put(client: Client = client) -> Future[Any]:
            return client.put_async("rv8-race", b"abc")

        futures = _race_close([get, put, get, put], client.close, outcomes, max_calls=20_000)
        for fut in futures:  # futures that were accepted end with a result or a MooncakeError
            err = fut.exception(timeout=30)
            assert err is None or isinstance(err, MooncakeError), f"future of trial {trial}: {err!r}"
    raw = {k: n for k, n in outcomes.items() if k.startswith("RAW")}
    assert not raw, f"async calls racing close() raised raw errors: {raw} (all outcomes: {outcomes})"


class _ArrivalOrderLock:
    """A lock granted in the order its callers arrived (a ticket lock), which records the names of
    the threads that asked for it: it pins which of two threads waiting for it runs first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._serving = 0
        self.arrivals: list[str] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        assert blocking and timeout == -1, "only plain acquire() and with-blocks are supported"
        with self._cond:
            ticket = self._next
            self._next += 1
            self.arrivals.append(threading.current_thread().name)
            self._cond.wait_for(lambda: self._serving == ticket)
        return True

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_an_async_call_that_raced_close_does_not_start_a_new_pool_after_close(one_agent: LocalCluster) -> None:
    """The other face of the same check outside the lock: on a client that had no pool yet, an
    async call that passed _check_open before close() took the lock creates a fresh
    ThreadPoolExecutor after close() returned, with a live worker thread nothing ever shuts down
    (close() promises to release threads). The interleaving is pinned by holding the client's
    _pool_lock while close() and then the call queue for it (the same order the race produces)."""
    with connect(one_agent.redis_url, namespace=one_agent.namespace) as setup:
        setup.put("rv8-cold", b"abc")
    leaked = 0
    raw: list[str] = []
    for _ in range(6):
        client = connect(one_agent.redis_url, namespace=one_agent.namespace)
        errors: list[BaseException] = []

        def call(client: Client = client, errors: list = errors) -> None:
            try:
                client.get_async("rv8-cold").exception(timeout=30)
            except BaseException as exc:
                errors.append(exc)

        # Sleeps did not place this under load (the call could queue first, or close() get the
        # lock late), and threading.Lock grants no order: a lock granted in arrival order, that
        # says who waits for it, places close() first and the call second for certain.
        lock = _ArrivalOrderLock()
        client._pool_lock = lock  # type: ignore[assignment]
        with lock:
            closer = threading.Thread(target=client.close, name="rv8-closer")
            closer.start()
            assert wait_until(lambda lock=lock: "rv8-closer" in lock.arrivals, 10)  # before it sets _closed
            caller = threading.Thread(target=call, name="rv8-caller")
            caller.start()
            # The call passed any check made outside the lock and waits for it too.
            assert wait_until(lambda lock=lock: "rv8-caller" in lock.arrivals, 10)
        closer.join(30)
        caller.join(30)
        assert not closer.is_alive() and not caller.is_alive()
        raw += [_classify(e) for e in errors if not isinstance(e, MooncakeError)]
        pool = client._pool
        if pool is not None and not pool._shutdown:
            leaked += 1
            pool.shutdown(wait=True)  # ours to clean up: the test must not leak the thread either
    assert not raw, raw
    assert leaked == 0, f"{leaked}/6 closed clients were left with a live thread pool created after close()"


def test_close_ends_async_operations_in_flight_promptly_with_a_closed_error(
    one_agent: LocalCluster, stopped_agent: Callable[[], None]
) -> None:
    """close() called pool.shutdown(wait=True) *before* it closed the TCP transport and the index,
    and nothing in the read or put path checked _closed again once started. So with a get_async
    and a put_async blocked on a stalled agent, close() (and a `with` block's exit) blocked until
    those transfers timed out (timeout_s, more with retries or several replicas), and their
    futures ended with TransferError/NoCapacity about the agent, not the MooncakeError('client is
    closed') the README promises for operations under way. close() now shuts down the connections
    of operations in flight first, and their retry loops end them with 'client is closed'."""
    timeout_s = 4.0
    with connect(one_agent.redis_url, namespace=one_agent.namespace) as setup:
        setup.put("rv8-stall", np.arange(1000, dtype=np.int64))
    client = connect(one_agent.redis_url, namespace=one_agent.namespace, transports=("tcp",), timeout_s=timeout_s)
    try:
        client.get("rv8-stall")  # a pooled connection to the agent
        stopped_agent()
        reading = client.get_async("rv8-stall")
        writing = client.put_async("rv8-stall-2", b"xyz")
        # Both are waiting on the stalled agent once it holds their requests (READ, RESERVE).
        assert wait_until(lambda: requests_waiting_at(one_agent.agents[0].endpoint) >= 2, 10)
        started = time.monotonic()
        client.close()
        took = time.monotonic() - started
    finally:
        client.close()
    outcomes = {}
    for name, fut in (("get_async", reading), ("put_async", writing)):
        exc = fut.exception(timeout=4 * timeout_s)
        outcomes[name] = f"{type(exc).__name__}: {exc}"
    assert took < timeout_s / 2, (
        f"close() took {took:.1f} s: it waited for the in-flight transfers to time out "
        f"(timeout_s={timeout_s}); futures ended with {outcomes}"
    )
    assert all("closed" in o for o in outcomes.values()), outcomes


def _outcome(fut: Future[Any], timeout_s: float) -> str:
    exc = fut.exception(timeout=timeout_s)
    return "ok" if exc is None else f"{type(exc).__name__}: {exc}"


def _published_host_used(client: Client, timeout_s: float = 6.0) -> int:
    """Used bytes of the only agent's host tier, from a heartbeat sent after this call began."""
    start = time.monotonic()
    while True:
        (node,) = client.stat().nodes
        used = next(t.used_bytes for t in node.tiers if t.tier == "host")
        if node.heartbeat_age_s < time.monotonic() - start - 0.05 or time.monotonic() - start > timeout_s:
            return used
        time.sleep(0.1)


def test_a_put_cut_short_by_close_commits_nothing_and_its_reservation_is_reclaimed(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """The agent stalls (SIGSTOP) while a 24 MiB TCP put is under way, once its pending record is
    written (so its reservation is made and its bytes are on their way), and the client is closed.
    The put ends at once with 'client is closed' and is abandoned like any failed put: no object,
    no pending record, and its reservation, which the agent can no longer be asked to free, is
    reclaimed at the agent's reservation timeout. Should the put have finished before the stall,
    its object must be whole."""
    cluster = make_cluster(1, host_bytes=64 * MiB, reserve_timeout_s=2.0)
    pid = cluster.agents[0].pid
    observer = connect(cluster.redis_url, namespace=cluster.namespace)
    writer = connect(cluster.redis_url, namespace=cluster.namespace, transports=("tcp",), timeout_s=10.0)
    value = np.random.default_rng(5).integers(0, 256, 24 * MiB, dtype=np.uint8)
    pending = observer.index.prefix + "pend:*"
    stopped = False
    try:
        baseline = _published_host_used(observer)
        writer.put("rv8-cut-warm", b"x")  # connections and node table in place
        baseline = _published_host_used(observer)
        fut = writer.put_async("rv8-cut", value)
        deadline = time.monotonic() + 10
        while not fut.done() and not observer.index.redis.keys(pending) and time.monotonic() < deadline:
            time.sleep(0.0005)
        stop_process(pid)
        stopped = True
        # The put waits on the stalled agent once its bytes queue there (unless it ended first, or
        # the agent stopped with every byte read and its reply not yet sent: then none queue, and
        # the put waits for that reply, which is under way all the same).
        endpoint = cluster.agents[0].endpoint
        wait_until(lambda: fut.done() or requests_waiting_at(endpoint) >= 1, 3)
        started = time.monotonic()
        writer.close()
        took = time.monotonic() - started
        outcome = _outcome(fut, 20)
        os.kill(pid, signal.SIGCONT)
        stopped = False
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        writer.close()
    try:
        assert took < 5.0, f"close() took {took:.1f} s with a put in flight ({outcome})"
        if outcome == "ok":  # it finished before the stall: whole, and nothing to reclaim
            assert bytes(observer.get("rv8-cut").tobytes()) == value.tobytes()
            return
        assert outcome == "MooncakeError: client is closed", outcome
        assert not observer.exists("rv8-cut"), "a put cut short by close() was committed"
        assert not observer.index.redis.keys(pending), "a put cut short by close() left its pending record"
        settled = time.monotonic() + cluster.reserve_timeout_s + 10
        while _published_host_used(observer) != baseline and time.monotonic() < settled:
            time.sleep(0.2)
        assert _published_host_used(observer) == baseline, "the cut put's reservation was never reclaimed"
    finally:
        observer.close()


def test_prefix_cache_close_ends_its_loads_in_flight_promptly_and_leaves_the_client_open(
    one_agent: LocalCluster, stopped_agent: Callable[[], None]
) -> None:
    """PrefixCache.close() waited for its pool like the client's close() did: a load_async reading
    from a stalled agent held it until timeout_s. Now it shuts down the connections of its own
    loads in flight (the client's others are left alone): the load ends at once with
    'PrefixCache is closed', its pins are released, and the client goes on working."""
    timeout_s = 4.0
    client = connect(one_agent.redis_url, namespace=one_agent.namespace, transports=("tcp",), timeout_s=timeout_s)
    tokens = list(range(8))
    try:
        with PrefixCache(client, "rv8-pcs", chunk_tokens=4) as writer:
            writer.store(tokens, [np.zeros(4, np.float32), np.ones(4, np.float32)])
        cache = PrefixCache(client, "rv8-pcs", chunk_tokens=4)
        client.get(cache.keys(tokens)[0])  # a pooled connection to the agent
        stopped_agent()
        loading = cache.load_async(tokens)
        # Matched and pinned; its read waits on the stalled agent.
        assert wait_until(lambda: requests_waiting_at(one_agent.agents[0].endpoint) >= 1, 10)
        started = time.monotonic()
        cache.close()
        took = time.monotonic() - started
        outcome = _outcome(loading, 4 * timeout_s)
        os.kill(one_agent.agents[0].pid, signal.SIGCONT)
        assert took < timeout_s / 2, f"PrefixCache.close() took {took:.1f} s; the load ended with {outcome}"
        assert outcome == "MooncakeError: PrefixCache is closed", outcome
        assert cache.refcounts(tokens) == [0, 0], "the cut load left its chunks pinned"
        got = client.get(cache.keys(tokens)[1])  # the client was not closed with the cache
        assert got.tolist() == [1.0] * 4
    finally:
        client.close()


def test_client_close_ends_a_prefix_load_in_flight_with_a_closed_error_not_a_miss(
    one_agent: LocalCluster, stopped_agent: Callable[[], None]
) -> None:
    """A PrefixCache load reads through the client; cut short by the client's close(), its reads
    fail, and load() took any failed read for a chunk gone missing: the hit ended there, so the
    caller saw a miss (0 tokens) instead of the error. It ends with 'client is closed' now."""
    timeout_s = 4.0
    client = connect(one_agent.redis_url, namespace=one_agent.namespace, transports=("tcp",), timeout_s=timeout_s)
    tokens = list(range(8))
    cache = PrefixCache(client, "rv8-pcc", chunk_tokens=4)
    try:
        cache.store(tokens, [np.zeros(4, np.float32), np.ones(4, np.float32)])
        client.get(cache.keys(tokens)[0])
        stopped_agent()
        loading = cache.load_async(tokens)
        assert wait_until(lambda: requests_waiting_at(one_agent.agents[0].endpoint) >= 1, 10)
        started = time.monotonic()
        client.close()
        took = time.monotonic() - started
        outcome = _outcome(loading, 4 * timeout_s)
    finally:
        cache.close()
        client.close()
    assert took < timeout_s / 2, f"close() took {took:.1f} s; the load ended with {outcome}"
    assert outcome == "MooncakeError: client is closed", outcome


def test_prefix_cache_load_async_racing_close_gets_a_mooncake_error(one_agent: LocalCluster) -> None:
    """PrefixCache.load_async has the client's pattern: _check_open() outside the lock, then
    submit() to a pool that close() shuts down. A load_async that passed the check while close()
    ran raises a raw RuntimeError('cannot schedule new futures after shutdown') instead of
    MooncakeError('PrefixCache is closed')."""
    client = connect(one_agent.redis_url, namespace=one_agent.namespace)
    outcomes: dict[str, int] = {}
    try:
        tokens = list(range(8))
        with PrefixCache(client, "rv8-pc", chunk_tokens=4) as writer:
            writer.store(tokens, [np.zeros(4, np.float32), np.ones(4, np.float32)])
        for _ in range(5):
            cache = PrefixCache(client, "rv8-pc", chunk_tokens=4)

            def load(cache: PrefixCache = cache) -> Future[Any]:
                return cache.load_async(tokens)

            for fut in _race_close([load] * 3, cache.close, outcomes, max_calls=5_000):
                if fut.exception(timeout=30) is None:
                    fut.result().release()  # type: ignore[attr-defined]
    finally:
        client.close()
    raw = {k: n for k, n in outcomes.items() if k.startswith("RAW")}
    assert not raw, f"load_async racing PrefixCache.close() raised raw errors: {raw} (all: {outcomes})"


# ---- sources changed while a put is in flight ------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        pytest.param({}, id="shm"),
        pytest.param({"transports": ("tcp",)}, id="tcp"),
        pytest.param({"transports": ("tcp",), "stripe_bytes": MiB}, id="tcp-striped"),
    ],
)
def test_a_source_changed_during_put_async_never_commits_an_unreadable_object(
    one_agent: LocalCluster, path: dict[str, Any]
) -> None:
    """put_async takes the caller's buffer without a copy (DESIGN.md invariant 5). PutPath.plan
    hashed the source (checksum_of) long before copy_fenced / write_from copied it, with the index
    round trips in between, so a caller that reused its buffer meanwhile got a successful put whose
    recorded checksum did not describe the stored bytes: exists() was True, and every get() by a
    client with verify_checksum failed with 'checksum mismatch' forever, as if the store corrupted
    it. The checksum committed is now that of the bytes where they landed (the arena copy on the
    same host; the agent's DIGEST over TCP, striped or not). A put must either store an object
    whose checksum matches its bytes, or fail."""
    client = connect(one_agent.redis_url, namespace=one_agent.namespace, verify_checksum=True, **path)
    unreadable: list[str] = []
    stored = 0
    try:
        for trial in range(3):
            key = f"rv8-mut-{trial}"
            source = np.zeros(4 * MiB, np.uint8)
            fut = client.put_async(key, source)
            i = 0
            deadline = time.monotonic() + 20
            while not fut.done() and i < 2_000_000 and time.monotonic() < deadline:
                source[i % source.size] = i % 255 + 1  # the caller reuses its buffer
                i += 1
            try:
                fut.result(timeout=30)
            except MooncakeError:
                continue  # refusing the put is a correct answer
            stored += 1
            try:
                client.get(key)
            except MooncakeError as exc:
                unreadable.append(f"{key} (exists={client.exists(key)}): {exc}")
    finally:
        client.close()
    assert not unreadable, f"puts that succeeded stored objects no verifying reader can read: {unreadable}"
    assert stored, "every put was refused: with one replica the bytes that landed are always consistent"


@pytest.mark.parametrize("transports", [("shm", "tcp"), ("tcp",)], ids=["shm", "tcp"])
def test_replicas_of_a_source_changed_during_put_async_all_match_the_committed_checksum(
    make_cluster: Callable[..., LocalCluster], transports: tuple[str, ...]
) -> None:
    """With two replicas, each is copied from the caller's buffer in turn, so a buffer changed
    between the copies leaves replicas with different bytes, and one checksum cannot describe both.
    Such a put must fail with InvalidValue and store nothing; a put that succeeds must have every
    replica match the checksum it committed (a reader may be sent to either one)."""
    cluster = make_cluster(2, host_bytes=32 * MiB)
    client = connect(cluster.redis_url, namespace=cluster.namespace, transports=transports)
    outcomes: dict[str, int] = {}
    mismatched: list[str] = []
    try:
        for trial in range(4):
            key = f"rv8-mut2-{trial}"
            source = np.zeros(2 * MiB, np.uint8)
            fut = client.put_async(key, source, replicas=2)
            i = 0
            deadline = time.monotonic() + 20
            while not fut.done() and i < 2_000_000 and time.monotonic() < deadline:
                source[i % source.size] = i % 255 + 1
                i += 1
            exc = fut.exception(timeout=30)
            if exc is not None:
                assert isinstance(exc, InvalidValue) and "changed while it was put" in str(exc), repr(exc)
                assert not client.exists(key), f"{key}: a put refused for differing replicas stored something"
                outcomes["refused"] = outcomes.get("refused", 0) + 1
                continue
            outcomes["stored"] = outcomes.get("stored", 0) + 1
            meta = client.object_meta(key)
            assert meta is not None and len(meta.replicas) == 2
            nodes = client._node_table(refresh=True)
            for replica in meta.replicas:  # each replica on its own, not just the one a get picks
                got = bytearray(meta.size_bytes)
                endpoint = nodes[replica.node_id].tcp_endpoint
                client._tcp.read_into(endpoint, replica.alloc_id, replica.offset, memoryview(got))
                if xxhash.xxh3_64_intdigest(got) != meta.checksum:
                    mismatched.append(f"{key} on {replica.node_id}")
    finally:
        client.close()
    assert not mismatched, f"replicas whose bytes fail the committed checksum: {mismatched} ({outcomes})"


def test_put_async_keeps_its_source_alive_when_the_caller_drops_it(one_agent: LocalCluster) -> None:
    """The caller's only reference to the value may go right after put_async (a temporary): the
    future holds it until the put is done, so the stored bytes are the value's."""
    client = connect(one_agent.redis_url, namespace=one_agent.namespace)
    try:
        futures = [client.put_async(f"rv8-tmp-{i}", np.full(256 * 1024, i, np.uint8)) for i in range(8)]
        for fut in futures:
            assert fut.result(timeout=30) is None
        for i in range(8):
            got = client.get(f"rv8-tmp-{i}")
            assert got.shape == (256 * 1024,) and bool((got == i).all())
    finally:
        client.close()


# ---- futures: results, errors, cancel, many threads --------------------------------------------------


def test_futures_carry_results_and_mooncake_errors(shared_client: Client) -> None:
    """Each *_async future holds what the synchronous call returns (None for a put, the bytes
    written for get_into, the stored array for get), and bad input arrives as the future's
    MooncakeError subclass, naming the value."""
    key = _key("fut")
    value = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert shared_client.put_async(key, value).result(timeout=30) is None
    got = shared_client.get_async(key).result(timeout=30)
    assert got.dtype == value.dtype and got.shape == value.shape and np.array_equal(got, value)
    out = np.zeros(30, np.float32)
    assert shared_client.get_into_async(key, out).result(timeout=30) == value.nbytes
    assert np.array_equal(out[:24].reshape(2, 3, 4), value)
    cases: list[tuple[Future[object], type[MooncakeError], str]] = [
        (shared_client.get_async(""), InvalidKey, "must not be empty"),
        (shared_client.get_async("x" * (MAX_KEY_BYTES + 1)), InvalidKey, f"the limit is {MAX_KEY_BYTES} B"),
        (shared_client.put_async(key + "-bad", [1, 2]), InvalidValue, "cannot store a value of type list"),
        (shared_client.put_async(key + "-r", b"x", replicas=0), InvalidValue, r"replicas must be an int in 1\.\.16"),
        (shared_client.get_into_async(key, bytearray(10)), InvalidValue, f"out holds 10 B but key {key!r} is 96 B"),
        (shared_client.get_into_async(key, bytes(96)), InvalidValue, "read-only"),
        (shared_client.get_into_async(key, np.zeros(48, np.float32)[::2]), InvalidValue, "not C-contiguous"),
        (shared_client.get_into_async(key, np.empty(96, object)), InvalidValue, "dtype object"),
    ]
    for fut, kind, fragment in cases:
        exc = fut.exception(timeout=30)
        assert isinstance(exc, kind), f"{fragment}: {exc!r}"
        with pytest.raises(kind, match=fragment):
            fut.result()
    shared_client.remove(key)


def test_a_cancelled_queued_put_async_stores_nothing(one_agent: LocalCluster) -> None:
    """A put_async still queued behind others (io_threads=1) can be cancelled; a cancelled put
    must never run."""
    client = connect(one_agent.redis_url, namespace=one_agent.namespace, io_threads=1)
    try:
        busy = [client.put_async(f"rv8-busy-{i}", np.zeros(4 * MiB, np.uint8)) for i in range(3)]
        queued = client.put_async("rv8-cancelled", b"never")
        cancelled = queued.cancel()
        for fut in busy:
            fut.result(timeout=60)
        if cancelled:
            assert queued.cancelled()
            assert not client.exists("rv8-cancelled")
        else:  # it had started already: it must then complete normally
            assert queued.result(timeout=30) is None
    finally:
        client.close()


def test_many_threads_of_async_puts_and_gets_round_trip_byte_exact(one_agent: LocalCluster) -> None:
    """Four threads each issue put_async / get_async / get_into_async on one client (the README
    says a Client is thread-safe), with values of several dtypes and shapes, some over the stripe
    size; every result is byte-exact with its dtype and shape."""
    client = connect(one_agent.redis_url, namespace=one_agent.namespace, stripe_bytes=256 * 1024)
    dtypes = [np.float16, np.float32, np.int64, np.uint8, np.complex64, np.bool_]
    problems: list[str] = []

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        for i in range(12):
            dtype = dtypes[(t + i) % len(dtypes)]
            shape = (int(rng.integers(1, 64)), int(rng.integers(1, 9 if i % 4 else 4096)))
            value = (
                rng.integers(0, 2, size=shape).astype(dtype) if dtype is np.bool_ else rng.random(shape).astype(dtype)
            )
            key = f"rv8-mt-{t}-{i}"
            client.put_async(key, value).result(timeout=60)
            got = client.get_async(key).result(timeout=60)
            out = np.empty_like(value)
            written = client.get_into_async(key, out).result(timeout=60)
            if got.dtype != value.dtype or got.shape != value.shape or got.tobytes() != value.tobytes():
                problems.append(f"{key}: get gave {got.dtype}{got.shape}")
            if written != value.nbytes or out.tobytes() != value.tobytes():
                problems.append(f"{key}: get_into wrote {written} B")

    threads = [threading.Thread(target=lambda t=t: _record(work, t, problems)) for t in range(4)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads), "an async round trip hung"
    finally:
        client.close()
    assert not problems, problems[:5]


def _record(work: Callable[[int], None], t: int, problems: list[str]) -> None:
    try:
        work(t)
    except BaseException as exc:
        problems.append(f"thread {t}: {exc!r}")


# ---- batches -------------------------------------------------------------------------------------


def _values() -> dict[str, object]:
    rng = np.random.default_rng(8)
    values: dict[str, object] = {
        "bytes": bytes(range(256)) * 3,
        "bytearray": bytearray(b"\x00\xffmooncake" * 5),
        "empty": b"",
        "memoryview-2d": memoryview(np.arange(12, dtype=np.int32).reshape(3, 4)),
        "array-d": array.array("d", [1.5, -2.25, 3.0]),
        "scalar-f64": np.array(2.5),
        "zero-rows": np.zeros((0, 5), np.int16),
    }
    for dtype in ("?", "i1", "u2", "<i4", "<i8", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16"):
        for shape in ((7,), (3, 5), (2, 3, 4)):
            raw = rng.random(shape) * 100
            values[f"{np.dtype(dtype).str}-{shape}"] = (raw > 50) if dtype == "?" else raw.astype(dtype)
    return values


def test_batch_round_trips_keep_bytes_dtype_and_shape(shared_client: Client) -> None:
    """put_many → get_many gives every value back byte-exact, numpy arrays with their dtype and
    shape, bytes/bytearray as 1-D uint8, buffers with the format and shape they export;
    get_many_into fills caller buffers and returns the byte counts; remove_many removes them."""
    values = _values()
    keys = {name: _key(name) for name in values}
    shared_client.put_many({keys[n]: v for n, v in values.items()})
    got = shared_client.get_many([keys[n] for n in values] + [_key("missing")])
    assert got[-1] is None
    for (name, value), back in zip(values.items(), got, strict=False):
        expected = np.asarray(memoryview(value)) if not isinstance(value, np.ndarray) else value  # type: ignore[arg-type]
        if isinstance(value, bytes | bytearray):
            expected = np.frombuffer(value, np.uint8)
        assert back.dtype == expected.dtype and back.shape == expected.shape, name
        assert back.tobytes() == expected.tobytes(), name
    outs = [bytearray(memoryview(v).nbytes) for v in values.values()]  # type: ignore[arg-type]
    sizes = shared_client.get_many_into([keys[n] for n in values], outs)
    for (name, value), out, size in zip(values.items(), outs, sizes, strict=True):
        assert size == memoryview(value).nbytes and bytes(out) == memoryview(value).tobytes(), name  # type: ignore[arg-type]
    assert shared_client.remove_many([keys[n] for n in values]) == [True] * len(values)
    assert shared_client.get_many([keys[n] for n in values]) == [None] * len(values)


def test_batch_calls_refuse_bad_keys_and_buffers_with_mooncake_errors(shared_client: Client) -> None:
    """Bad input anywhere in a batch is refused before anything is stored, with a MooncakeError
    subclass that names the value and the limit (DESIGN.md invariant 6)."""
    ok, at_limit = _key("ok"), "é" * (MAX_KEY_BYTES // 2)
    shared_client.put_many({ok: b"x", at_limit: b"limit"})
    assert [v.tobytes() for v in shared_client.get_many([ok, at_limit])] == [b"x", b"limit"]
    too_long = "é" * (MAX_KEY_BYTES // 2) + "x"
    for call in (
        lambda: shared_client.put_many({ok + "-2": b"y", too_long: b"z"}),
        lambda: shared_client.get_many([ok, too_long]),
        lambda: shared_client.get_many_into([ok, too_long], [bytearray(1), bytearray(1)]),
        lambda: shared_client.remove_many([ok, too_long]),
    ):
        with pytest.raises(InvalidKey, match=f"{MAX_KEY_BYTES + 1} B of UTF-8; the limit is {MAX_KEY_BYTES} B"):
            call()
    assert not shared_client.exists(ok + "-2") and shared_client.exists(ok)
    with pytest.raises(InvalidValue, match=r"cannot store a value of type dict"):
        shared_client.put_many({ok + "-3": b"fine", ok + "-4": {"not": "a buffer"}})
    assert not shared_client.exists(ok + "-3")
    with pytest.raises(InvalidValue, match=rf"outs\[1\] holds 0 B but key {ok!r} is 1 B"):
        shared_client.get_many_into([at_limit, ok], [bytearray(5), bytearray(0)])
    with pytest.raises(InvalidValue, match="2 keys but 1 output buffers"):
        shared_client.get_many_into([ok, at_limit], [bytearray(5)])
    with pytest.raises(InvalidValue, match="read-only"):
        shared_client.get_many_into([ok], [np.frombuffer(b"abcd", np.uint8)])
    shared_client.remove_many([ok, at_limit])


def test_remove_many_that_hits_a_pinned_key_says_what_it_removed(one_agent: LocalCluster) -> None:
    """remove_many runs the whole batch in the index (remove.lua removes every unpinned key), then
    raises ObjectPinned naming only the pinned ones: the per-key results are dropped, so the
    caller cannot tell that the other keys are gone (the message says nothing of them). It should
    either remove nothing, or say which keys it removed (message or exception attribute)."""
    client = connect(one_agent.redis_url, namespace=one_agent.namespace)
    pins = PrefixIndex(client.index)
    try:
        client.put_many({"rv8-a": b"1", "rv8-pinned": b"2", "rv8-b": b"3"})
        assert pins.pin(["rv8-pinned"], pin_id="rv8", lease_ms=60_000) == [True]
        with pytest.raises(ObjectPinned) as info:
            client.remove_many(["rv8-a", "rv8-pinned", "rv8-b"])
        kept = client.exists("rv8-a") and client.exists("rv8-b")
        message = str(info.value)
        told = "rv8-a" in message and "rv8-b" in message and "removed" in message
        assert kept or told, f"remove_many removed rv8-a and rv8-b but raised only {message!r}; the caller cannot tell"
    finally:
        pins.unpin(["rv8-pinned"], pin_id="rv8")
        client.close()


def test_put_many_that_hits_a_pinned_key_says_what_it_stored(one_agent: LocalCluster) -> None:
    """put_many commits the batch in one script: every unpinned key is replaced, the pinned one
    is refused, and ObjectPinned names only the refused key; nothing tells the caller that the
    others were stored (a retry of the whole batch writes them again). It should either store
    nothing, or say which keys it stored."""
    client = connect(one_agent.redis_url, namespace=one_agent.namespace)
    pins = PrefixIndex(client.index)
    try:
        client.put("rv8-p", b"old")
        assert pins.pin(["rv8-p"], pin_id="rv8", lease_ms=60_000) == [True]
        with pytest.raises(ObjectPinned) as info:
            client.put_many({"rv8-n1": b"new", "rv8-p": b"new", "rv8-n2": b"new"})
        assert client.get("rv8-p").tobytes() == b"old"
        stored = client.exists("rv8-n1") or client.exists("rv8-n2")
        message = str(info.value)
        assert not stored or ("rv8-n1" in message and "rv8-n2" in message), (
            f"put_many stored rv8-n1/rv8-n2 but raised only {message!r}; the caller cannot tell"
        )
    finally:
        pins.unpin(["rv8-p"], pin_id="rv8")
        client.close()


def test_an_object_as_large_as_the_arena_fits_and_one_byte_more_fails_at_once(one_agent: LocalCluster) -> None:
    """Sizes at and past the limits, through the async API: as much as the agent keeps (its high
    watermark, 0.9, of the arena's capacity) is stored; one byte more, or one byte more than the
    arena, fails with a permanent NoCapacity naming both sizes, without waiting out timeout_s.
    (The whole arena was once stored, and evicted by the next pressure pass.)"""
    client = connect(one_agent.redis_url, namespace=one_agent.namespace, lease_ms=200)
    try:
        kept = int(0.9 * 32 * MiB) // 64 * 64  # in the arena's 64 B units
        full = np.full(kept, 7, np.uint8)
        client.put_async("rv8-full", full).result(timeout=60)
        assert int(client.get_into_async("rv8-full", np.empty_like(full)).result(timeout=60)) == full.nbytes
        client.remove("rv8-full")
        for size, limit in ((kept + 1, kept), (32 * MiB + 1, 32 * MiB)):
            exc = client.put_async("rv8-over", np.zeros(size, np.uint8)).exception(timeout=60)
            assert isinstance(exc, MooncakeError) and getattr(exc, "permanent", False), repr(exc)
            assert str(size) in str(exc) and str(limit) in str(exc)
    finally:
        client.close()


# ---- bad buffers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["sparse_csr", "sparse_csc", "sparse_coo"])
def test_a_sparse_torch_tensor_is_refused_with_invalid_value_that_says_to_densify(
    shared_client: Client, layout: str
) -> None:
    """buffers._torch_to_numpy asks tensor.is_contiguous() before anything else; compressed sparse
    tensors (CSR/CSC/BSR/BSC) raise a raw RuntimeError('Sparse CSR tensors do not have
    is_contiguous') from put, put_async, get_into and get_into_async. A COO tensor is refused
    with 'not contiguous; call .contiguous()', advice that itself raises RuntimeError
    ('unsupported memory format option Contiguous'). Both should be InvalidValue naming the
    layout, pointing at .to_dense()."""
    import torch  # a test requirement (pyproject test extra): its absence is a failure

    tensor = getattr(torch.eye(4), f"to_{layout}")()
    key = _key("sparse")
    calls: dict[str, Callable[[], object]] = {
        "put": lambda: shared_client.put(key, tensor),
        "put_async": lambda: shared_client.put_async(key, tensor).result(timeout=30),
        "get_into": lambda: shared_client.get_into(key, tensor),
        "get_into_async": lambda: shared_client.get_into_async(key, tensor).result(timeout=30),
    }
    shared_client.put(key, np.zeros(16, np.float32))
    outcomes: dict[str, str] = {}
    for name, call in calls.items():
        try:
            call()
            outcomes[name] = "accepted"
        except InvalidValue as exc:
            if "dense" not in str(exc) and "sparse" not in str(exc):
                outcomes[name] = f"InvalidValue without naming the layout: {exc}"
        except BaseException as exc:
            outcomes[name] = _classify(exc)
    shared_client.remove(key)
    assert not outcomes, outcomes


def test_every_call_on_a_closed_client_says_closed(one_agent: LocalCluster) -> None:
    """After close(), every method, batch and async ones and empty batches included, raises
    MooncakeError('client is closed') at once, never touching a transport."""
    client = connect(one_agent.redis_url, namespace=one_agent.namespace)
    client.put("rv8-closed", b"abc")
    client.get_async("rv8-closed").result(timeout=30)
    client.close()
    calls: dict[str, Callable[[], object]] = {
        "put": lambda: client.put("rv8-closed", b"x"),
        "put_many": lambda: client.put_many({"rv8-closed": b"x"}),
        "put_many({})": lambda: client.put_many({}),
        "get": lambda: client.get("rv8-closed"),
        "get_into": lambda: client.get_into("rv8-closed", bytearray(3)),
        "get_many": lambda: client.get_many(["rv8-closed"]),
        "get_many([])": lambda: client.get_many([]),
        "get_many_into": lambda: client.get_many_into(["rv8-closed"], [bytearray(3)]),
        "remove_many": lambda: client.remove_many(["rv8-closed"]),
        "exists": lambda: client.exists("rv8-closed"),
        "stat": lambda: client.stat(),
        "get_async": lambda: client.get_async("rv8-closed"),
        "put_async": lambda: client.put_async("rv8-closed", b"x"),
        "get_into_async": lambda: client.get_into_async("rv8-closed", bytearray(3)),
        "with": lambda: client.__enter__(),
    }
    for name, call in calls.items():
        with pytest.raises(MooncakeError, match="client is closed"):
            call()
        assert client._tcp._peers == {} and not client._shm.mapped_any(), f"{name} reopened a transport"


def test_bfloat16_round_trips_through_the_async_api(shared_client: Client) -> None:
    """A CPU bfloat16 tensor put with put_async comes back from get_async as a bfloat16 torch
    tensor of its shape (README), and get_into_async fills a bfloat16 tensor bit-exact."""
    import torch  # a test requirement (pyproject test extra): its absence is a failure

    value = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16)
    key = _key("bf16")
    shared_client.put_async(key, value).result(timeout=30)
    back = shared_client.get_async(key).result(timeout=30)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.bfloat16 and tuple(back.shape) == (4, 6)
    assert torch.equal(back, value)
    out = torch.empty(4, 6, dtype=torch.bfloat16)
    assert shared_client.get_into_async(key, out).result(timeout=30) == 48
    assert torch.equal(out, value)
    shared_client.remove(key)


def test_get_many_into_with_one_flat_array_says_one_buffer_per_key(shared_client: Client) -> None:
    """get_many_into takes a list of buffers or "one array with a row per key"; a 1-D array
    passes the is_collection_not_text check, so each of its elements (a numpy scalar) goes
    through as_destination and the call fails with 'out (uint8) is read-only' about an array the
    caller made writable. A bytearray or memoryview in the same place gets the right message
    ('outs must be buffers, one per key'); a flat array should too."""
    key = _key("flat")
    shared_client.put(key, b"abcd")
    try:
        with pytest.raises(InvalidValue) as info:
            shared_client.get_many_into([key], np.zeros(4, np.uint8))
        message = str(info.value)
        assert "read-only" not in message and "per key" in message, message
    finally:
        shared_client.remove(key)
