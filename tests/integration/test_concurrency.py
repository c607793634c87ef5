"""Concurrent writers and readers: every get returns exactly what some put wrote, and a remove or
replace racing with gets never yields a torn or freed read."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers import run_for

from mooncake_store import Client, KeyNotFound, LocalCluster, ObjectPinned, connect

KEYS = 8
ELEMENTS = 64 * 1024  # int64 elements: 512 KiB values


def make_value(key_id: int, writer: int, seq: int) -> np.ndarray:
    """A value whose every element is derived from its header, so a torn read cannot pass."""
    body = np.arange(ELEMENTS, dtype=np.int64) * 1_000_003 + (key_id << 40) + (writer << 32) + seq
    body[:3] = (key_id, writer, seq)
    return body


def check_value(key_id: int, value: np.ndarray) -> tuple[int, int]:
    assert value.dtype == np.int64 and value.shape == (ELEMENTS,)
    k, writer, seq = (int(x) for x in value[:3])
    assert k == key_id
    expected = make_value(key_id, writer, seq)
    assert np.array_equal(value, expected), f"torn value for key {key_id}: header {(k, writer, seq)}"
    return writer, seq


def worker(url: str, namespace: str, writer: int, seconds: float, transport: str, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        client = connect(url, namespace=namespace, transports=(transport,), lease_ms=500)
        rng = np.random.default_rng(writer)
        end = time.monotonic() + seconds
        seq = puts = gets = 0
        while time.monotonic() < end and puts + gets < 5000:
            key_id = int(rng.integers(KEYS))
            if rng.random() < 0.4:
                seq += 1
                client.put(f"c/{key_id}", make_value(key_id, writer, seq))
                puts += 1
            else:
                try:
                    check_value(key_id, client.get(f"c/{key_id}"))
                    gets += 1
                except KeyNotFound:
                    pass
        client.close()
        queue.put(("ok", writer, puts, gets))
    except BaseException as exc:  # report, the parent asserts
        queue.put(("error", writer, repr(exc), 0))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_four_client_processes(make_cluster: Callable[..., LocalCluster], transport: str) -> None:
    cluster = make_cluster(2, host_bytes=64 << 20)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(cluster.redis_url, cluster.namespace, w + 1, 4.0, transport, queue))
        for w in range(4)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    errors = [r for r in results if r[0] != "ok"]
    assert not errors, errors
    assert sum(r[3] for r in results) > 0 and sum(r[2] for r in results) > 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_remove_and_replace_race_with_gets(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], transport: str
) -> None:
    # Short leases make freed space come back fast, so reuse of the same memory is likely.
    cluster = make_cluster(1, host_bytes=16 << 20)
    writer = make_client(cluster, lease_ms=100)
    stop = threading.Event()
    failures: list[str] = []
    reads = [0]

    def mutate() -> None:
        seq = 0
        while not stop.is_set():
            seq += 1
            key_id = seq % 2
            try:
                if seq % 3 == 0:
                    writer.remove(f"c/{key_id}")
                else:
                    writer.put(f"c/{key_id}", make_value(key_id, 0, seq))
            except ObjectPinned:
                pass
            except Exception as exc:
                failures.append(f"writer: {exc!r}")
                return

    def read(client: Client) -> None:
        out = np.empty(ELEMENTS, dtype=np.int64)
        n = 0
        while not stop.is_set():
            key_id = n % 2
            n += 1
            try:
                if n % 2:
                    check_value(key_id, client.get(f"c/{key_id}"))
                else:
                    client.get_into(f"c/{key_id}", out)
                    check_value(key_id, out)
                reads[0] += 1
            except KeyNotFound:
                pass
            except AssertionError as exc:
                failures.append(str(exc))
                return
            except Exception as exc:
                failures.append(f"reader: {exc!r}")
                return

    readers = [make_client(cluster, transports=(transport,), lease_ms=100) for _ in range(2)]
    threads = [threading.Thread(target=mutate)] + [threading.Thread(target=read, args=(c,)) for c in readers]
    run_for(4.0, threads, stop)
    assert not failures, failures[:3]
    assert reads[0] > 0
