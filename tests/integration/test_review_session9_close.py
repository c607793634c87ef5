"""Review pass 9, chaos: close() racing puts and gets of its own client (split from
test_review_session9_chaos.py; the helpers are in chaos_kit.py). The one defect the pass found (a
lookup racing close() reopened Redis connections the closed client then held) is fixed: its test is
the second one here.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
from chaos_kit import (
    SIZES,
    MiB,
    add_agents,
    agents_match_index,
    spill_totals,
    value_of,
)
from helpers import socket_fds, tcp_sockets, wait_until

from mooncake_store import Client, KeyNotFound, LocalCluster, MooncakeError, connect


# ---- 3: close() racing puts and gets of its own client ---------------------------------------
def own_sockets_to(ports: set[int]) -> dict[int, int]:
    """Established TCP sockets of this process whose peer is one of ``ports`` on loopback."""
    mine = set(socket_fds("self"))
    count: dict[int, int] = {}
    for s in tcp_sockets():
        if s.state == "01" and s.inode in mine and s.remote_port in ports:
            count[s.remote_port] = count.get(s.remote_port, 0) + 1
    return count


@dataclass
class CloseRound:
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: threading.Event = field(default_factory=threading.Event)
    stored: dict[str, np.ndarray] = field(default_factory=dict)  # puts that returned
    refused: dict[str, str] = field(default_factory=dict)  # puts that raised: key -> error
    problems: list[str] = field(default_factory=list)
    ops_after_close: int = 0

    def problem(self, what: str) -> None:
        with self.lock:
            self.problems.append(what)


def close_round(
    cluster: LocalCluster, checker: Client, seed_values: dict[str, np.ndarray], seed: int, delay_s: float
) -> CloseRound:
    state = CloseRound()
    client = connect(cluster.redis_url, namespace=cluster.namespace, lease_ms=300, timeout_s=10)
    rng = random.Random(seed)

    def classify(op: str, exc: BaseException) -> None:
        if not isinstance(exc, MooncakeError):
            state.problem(f"{op}: not a MooncakeError: {exc!r}")
        elif state.closing.is_set() and not isinstance(exc, KeyNotFound) and str(exc) != "client is closed":
            state.problem(f"{op} under close(): {exc!r} (README: 'client is closed')")
        elif not state.closing.is_set():
            state.problem(f"{op} before close(): {exc!r}")

    def putter(t: int) -> None:
        r = random.Random(seed * 100 + t)
        n = 0
        while n < 150:  # bounded: no eviction may blur what a put left behind
            n += 1
            key = f"close/{seed}/{t}/{n}"
            key_id = seed * 10_000 + t * 1000 + n
            value = value_of(key_id, 0, r.choice(SIZES[:3]))
            time.sleep(0.01)
            try:
                if t == 2:
                    fut: Future[None] = client.put_async(key, value, replicas=r.choice([1, 2]))
                    fut.result(30)
                else:
                    client.put(key, value, replicas=r.choice([1, 2]))
                with state.lock:
                    state.stored[key] = value
            except BaseException as exc:
                with state.lock:
                    state.refused[key] = repr(exc)
                classify(f"put {key}", exc)
                if state.closing.is_set():
                    return
                if not isinstance(exc, MooncakeError):
                    return

    def reader(t: int) -> None:
        r = random.Random(seed * 100 + 50 + t)
        out = np.empty(4 * MiB, np.uint8)
        names = sorted(seed_values)
        while True:
            key = r.choice(names)
            try:
                if r.random() < 0.5:
                    got = client.get_many([key, r.choice(names)])
                    for k, arr in zip([key], got[:1], strict=True):
                        if arr is None or not np.array_equal(arr.view(np.uint8).reshape(-1), seed_values[k]):
                            state.problem(f"get_many {k}: wrong or missing bytes")
                else:
                    n = client.get_into(key, out)
                    if not np.array_equal(out[:n], seed_values[key]):
                        state.problem(f"get_into {key}: wrong bytes")
            except BaseException as exc:
                classify(f"get {key}", exc)
                if state.closing.is_set() or not isinstance(exc, MooncakeError):
                    return

    threads = [threading.Thread(target=putter, args=(t,)) for t in range(3)]
    threads += [threading.Thread(target=reader, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    time.sleep(delay_s + rng.random() * 0.2)
    state.closing.set()
    started = time.monotonic()
    client.close()
    took = time.monotonic() - started
    for t in threads:
        t.join(15)
    if any(t.is_alive() for t in threads):
        state.problem("a thread was still running 15 s after close()")
    if took > 5:
        state.problem(f"close() took {took:.1f} s")
    return state


def test_close_racing_puts_and_gets_keeps_the_close_contract(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0, reserve_timeout_s=2.0)
    add_agents(cluster)
    nodes = ["agent-0", "agent-1", "agent-2"]
    checker = make_client(cluster, lease_ms=300)
    seed_values = {f"seed/{i}": value_of(90_000 + i, 0, SIZES[i % 6]) for i in range(12)}
    checker.put_many(seed_values)
    ports = {int(a.endpoint.rsplit(":", 1)[1]) for a in cluster.agents}
    rounds = []
    problems: list[str] = []
    for seed, delay in ((1, 0.3), (2, 0.9), (3, 1.6)):
        # Agent connections only: the Redis ones have a test of their own (below).
        before = own_sockets_to(ports)
        r = close_round(cluster, checker, seed_values, seed, delay)
        rounds.append(r)
        problems += r.problems
        gc.collect()
        after = own_sockets_to(ports)
        if after != before:
            problems.append(f"round {seed}: agent sockets of the closed client still open: {before} -> {after}")
        # Puts that returned are stored whole; puts that raised stored nothing.
        for key, value in r.stored.items():
            try:
                got = checker.get(key)
            except KeyNotFound:
                problems.append(f"{key}: acknowledged put, KeyNotFound")
                continue
            if not np.array_equal(got.view(np.uint8).reshape(-1), value):
                problems.append(f"{key}: acknowledged put reads back wrong")
        for key, why in r.refused.items():
            if checker.exists(key):
                problems.append(f"{key}: put raised {why} but the key is stored")
        checker.remove_many(list(r.stored))
    assert not problems, problems[:8]
    assert sum(len(r.stored) for r in rounds) > 0
    assert spill_totals(checker, nodes)[2] == 0, "evictions: the load was sized to need none"
    # The cut puts' reservations are reclaimed at the agents' timeout (2 s).
    assert wait_until(lambda: agents_match_index(checker, nodes)[0], 12, 0.5), agents_match_index(checker, nodes)[1]


def test_a_lookup_racing_close_leaves_no_index_connection_open(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A reader thread has passed the client's open check and is about to look its key up when
    another thread closes the client (placed here by holding the lookup until close() returned;
    without the hold, four threads looping get() left a socket open in 3 of 8 closes). The get
    ends with "client is closed", as it should, but the lookup it made after close() opened a
    Redis connection that nothing closes: the closed client keeps a socket to the server."""
    cluster = make_cluster(1, host_bytes=8 * MiB)
    make_client(cluster).put("k", np.arange(1000, dtype=np.uint8))
    redis_port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
    gc.collect()
    before = own_sockets_to({redis_port}).get(redis_port, 0)
    client = connect(cluster.redis_url, namespace=cluster.namespace)
    assert client.exists("k")
    at_lookup, closed = threading.Event(), threading.Event()
    real_lookup = client.index.lookup

    def lookup_after_close(keys: list[str], *, lease_ms: int, counted: bool = True) -> object:
        at_lookup.set()
        closed.wait(10)
        return real_lookup(keys, lease_ms=lease_ms, counted=counted)

    client.index.lookup = lookup_after_close  # type: ignore[method-assign]
    outcome: list[str] = []

    def read() -> None:
        try:
            client.get("k")
            outcome.append("returned")
        except MooncakeError as exc:
            outcome.append(str(exc))

    reader = threading.Thread(target=read)
    reader.start()
    assert at_lookup.wait(10)
    client.close()
    closed.set()
    reader.join(10)
    assert outcome == ["client is closed"], outcome
    gc.collect()
    after = own_sockets_to({redis_port}).get(redis_port, 0)
    assert after == before, (
        f"{after - before} Redis connection(s) of the closed client still open: the lookup after close() "
        "reopened one and kept it"
    )
