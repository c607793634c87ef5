"""The measurements of `mooncake bench`: memcpy limits, timed loops, and the per-transport runner.

Every loop is bounded by time and by an iteration count, and every object size and key count is
kept within the room the cluster has to spare, so the benchmark never pushes an agent into moving
real data. Each measurement is a plain dict collected in :class:`Results`, so that ``bench_report``
can print it as a table or dump it as JSON unchanged.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mooncake_cli.bench_checks import ReadCheckFailed, check_batch_reads, check_reads, stamp
from mooncake_cli.context import Target
from mooncake_cli.exits import CliError
from mooncake_cli.signals import StopOnce
from rich.progress import Progress

from mooncake_store import Client
from mooncake_store.config import format_size
from mooncake_store.errors import TransferError
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20
GB = 1e9
#: Sources rotate over this many bytes (as in benchmarks/benchlib.py), so that neither memcpy nor a
#: store read copies from a source that sits hot in the last-level cache.
FOOTPRINT_BYTES = 64 * MiB
#: The benchmark fills no agent's host arena past this fraction (agents start moving data at 0.9),
#: and holds at once only this share of the headroom below it.
SAFE_FILL = 0.7
CAPACITY_SHARE = 0.25
#: Read leases of the benchmark's clients: a removed key's bytes come back this soon after its last
#: read, so one cell's keys are gone before the next cells add up (reads here take milliseconds).
LEASE_MS = 1000
ROOM_NOTE = "(what it may hold while keeping every agent under 70 % of its host arena)"
LATENCY_BYTES = 4 * KiB
BATCH_OBJECT_BYTES = 64 * KiB


def size_label(n: int) -> str:
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def max_iterations(size: int) -> int:
    """The count bound of a loop: enough to move ~2 GB, at most 20,000 calls."""
    return int(min(20_000, max(20, 2 * GB / size)))


#: The bench's handler of SIGINT, SIGTERM and SIGHUP, which the measuring loops check (a first
#: signal raised inside a finalizer is lost there, and the run went on for all its --seconds).
STOP = StopOnce()


def timed_loop(
    fn: Callable[[int], Any], seconds: float, count: int, *, warmup: int = 2
) -> tuple[int, float, list[float]]:
    """Run ``fn(i)`` until ``seconds`` or ``count`` runs out (at least 3 calls); returns
    (calls, seconds, per-call seconds)."""
    for i in range(warmup):
        STOP.check()
        fn(i)
    clock = time.perf_counter
    times: list[float] = []
    start = clock()
    deadline = start + seconds
    i = 0
    while i < count and (i < 3 or clock() < deadline):
        STOP.check()
        t0 = clock()
        fn(i)
        times.append(clock() - t0)
        i += 1
    return i, clock() - start, times


def slots_for(size: int, room_bytes: int) -> int:
    """How many distinct keys (or memcpy sources) a loop rotates over."""
    return max(1, min(64, FOOTPRINT_BYTES // size, room_bytes // size))


def memcpy_gbps(size: int, seconds: float, slots: int) -> float:
    """Single-thread numpy.copyto into one buffer, sources rotating over ``slots`` of them, as many
    as the store's keys of that size (slots_for with the cluster's room): the limit of a same-host
    read, which is one memcpy. Fewer sources than keys (a small arena holds fewer keys than
    FOOTPRINT_BYTES) made the store's reads look faster than the copy they are."""
    pool = np.ones(slots * size, dtype=np.uint8)  # touched, so no zero-page reads
    srcs = [pool[k * size : (k + 1) * size] for k in range(slots)]
    dst = np.empty(size, dtype=np.uint8)
    n, secs, _ = timed_loop(lambda i: np.copyto(dst, srcs[i % slots]), seconds, max_iterations(size))
    return n * size / secs / GB


def _pct_us(times: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(times), q) * 1e6) if times else float("nan")


@dataclass(slots=True)
class Results:
    prefix: str
    seconds: float
    memcpy: dict[int, float] = field(default_factory=dict)
    cells: list[dict[str, Any]] = field(default_factory=list)
    latency: list[dict[str, Any]] = field(default_factory=list)
    batch: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def ratio(self, gbps: float, size: int) -> float:
        limit = self.memcpy.get(size, 0.0)
        return gbps / limit if limit else float("nan")


def room_bytes(client: Client) -> tuple[int, int, int]:
    """(live agents, bytes the benchmark may hold at once, the most one object may take).

    The cluster may hold real data: past its high watermark (default 90 %) an agent demotes or
    evicts cold objects, so the benchmark stays below SAFE_FILL of each agent's host arena, and holds
    only a CAPACITY_SHARE of that headroom at a time since removed keys free their bytes only after
    their read leases run out."""
    live = {n.node_id for n in client.stat().live_nodes}
    headroom = [
        max(0, int(usage.capacity_bytes * SAFE_FILL) - usage.used_bytes)
        for node in client.index.nodes().values()
        if node.node_id in live and (usage := node.tier(TierKind.HOST)) is not None
    ]
    return len(live), int(sum(headroom) * CAPACITY_SHARE), max(headroom, default=0)


def shm_reachable(client: Client, key: str) -> bool:
    """Whether this process reads the cluster over shared memory: a put always lands (over TCP if it
    must), but a read restricted to shm fails when no replica's arena is mapped on this host."""
    probe = np.arange(LATENCY_BYTES, dtype=np.uint8)
    client.put(key, probe)
    try:
        client.get_into(key, np.empty_like(probe))
        return True
    except TransferError:
        return False
    finally:
        client.remove(key)


class Bench:
    """One run: the clients per transport, the progress display, the results."""

    def __init__(self, base: Client, target: Target, results: Results, progress: Progress) -> None:
        self.base = base
        self.target = target
        self.res = results
        self.progress = progress

    def run_transport(self, client: Client, transport: str, sizes: list[int], batch: int, room: int) -> None:
        seconds = self.res.seconds
        steps = 2 * len(sizes) + 2
        task = self.progress.add_task(transport, total=steps)

        def step(text: str) -> None:
            self.progress.update(task, description=f"{transport} {text}")

        for size in sizes:
            step(f"put {size_label(size)}")
            cell = self._throughput(client, transport, size, room, step)
            self.progress.advance(task, 2)
            if cell is not None:
                self.res.cells.append(cell)
        step("4 KiB latency")
        key = f"{self.res.prefix}{transport}/lat"
        small = np.arange(LATENCY_BYTES, dtype=np.uint8)
        dst = np.empty_like(small)
        client.put(key, small)
        n, _, times = timed_loop(lambda _i: client.get_into(key, dst), seconds, 5000, warmup=20)
        read = functools.partial(client.get_into, key, dst)
        checked(lambda: check_batch_reads(read, [small], [dst], f"{transport} 4 KiB get_into"))
        client.remove(key)
        self.res.latency.append({"transport": transport, "size_bytes": LATENCY_BYTES, "get_p50_us": _pct_us(times, 50),
                                 "get_p99_us": _pct_us(times, 99), "gets": n})  # fmt: skip
        self.progress.advance(task)
        step(f"batch {batch} x 64 KiB")
        if batch * BATCH_OBJECT_BYTES > room:
            reason = f"{batch} x 64 KiB does not fit in {format_size(room)} {ROOM_NOTE}"
            self.res.skipped.append({"transport": transport, "what": "batch", "reason": reason})
        else:
            self.res.batch.append(self._batch(client, transport, batch))
        self.progress.update(task, description=transport, advance=1)

    def _throughput(
        self, client: Client, transport: str, size: int, room: int, step: Callable[[str], None]
    ) -> dict[str, Any] | None:
        if size > room:
            reason = f"{size_label(size)} does not fit in {format_size(room)} {ROOM_NOTE}"
            self.res.skipped.append({"transport": transport, "what": size_label(size), "reason": reason})
            return None
        seconds, count = self.res.seconds, max_iterations(size)
        src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)  # writable: stamped
        dst = np.empty(size, dtype=np.uint8)
        keys = [f"{self.res.prefix}{transport}/{size}/{i}" for i in range(slots_for(size, room))]

        def put(i: int) -> None:
            stamp(src, i % len(keys))  # 8 bytes: each key's own value, for the check below
            client.put(keys[i % len(keys)], src)

        # Replacing a key frees its old bytes a little later; put waits for that room by itself.
        puts, put_s, _ = timed_loop(put, seconds, count, warmup=len(keys))
        step(f"get_into {size_label(size)}")
        gets, get_s, _ = timed_loop(lambda i: client.get_into(keys[i % len(keys)], dst), seconds, count)
        what = f"{transport} get_into of {size} B"
        checked(lambda: check_reads(lambda i: client.get_into(keys[i], dst), src, dst, len(keys), what))
        client.remove_many(keys)
        put_gbps, get_gbps = puts * size / put_s / GB, gets * size / get_s / GB
        return {
            "transport": transport,
            "size_bytes": size,
            "size": size_label(size),
            "keys": len(keys),
            "memcpy_gbps": self.res.memcpy[size],
            "put_gbps": put_gbps,
            "put_ratio": self.res.ratio(put_gbps, size),
            "puts": puts,
            "get_gbps": get_gbps,
            "get_ratio": self.res.ratio(get_gbps, size),
            "gets": gets,
        }

    def _batch(self, client: Client, transport: str, batch: int) -> dict[str, Any]:
        rng = np.random.default_rng(7)
        values = {
            f"{self.res.prefix}{transport}/b{i}": np.frombuffer(rng.bytes(BATCH_OBJECT_BYTES), dtype=np.uint8)
            for i in range(batch)
        }
        keys = list(values)
        outs = [np.empty(BATCH_OBJECT_BYTES, dtype=np.uint8) for _ in keys]
        total = batch * BATCH_OBJECT_BYTES
        seconds = self.res.seconds
        n_put, put_s, _ = timed_loop(lambda _i: client.put_many(values), seconds, 200, warmup=1)
        n_get, get_s, times = timed_loop(lambda _i: client.get_many_into(keys, outs), seconds, 200, warmup=1)
        read = lambda: client.get_many_into(keys, outs)  # noqa: E731
        checked(lambda: check_batch_reads(read, list(values.values()), outs, f"{transport} get_many_into"))
        client.remove_many(keys)
        get_gbps = n_get * total / get_s / GB
        return {
            "transport": transport,
            "objects": batch,
            "object_bytes": BATCH_OBJECT_BYTES,
            "put_many_gbps": n_put * total / put_s / GB,
            "get_many_gbps": get_gbps,
            "get_many_ratio": self.res.ratio(get_gbps, BATCH_OBJECT_BYTES),
            "get_many_p50_ms": _pct_us(times, 50) / 1e3,
            "batches": n_get,
        }


def checked(check: Callable[[], None]) -> None:
    """A read check's failure as the command's error (exit 1), naming what read back wrong."""
    try:
        check()
    except ReadCheckFailed as exc:
        raise CliError(str(exc)) from None


def cleanup(client: Client, prefix: str) -> int:
    """Remove every key under ``prefix``, including any a Ctrl-C left between its puts."""
    removed = 0
    while listing := client.index.list_keys(prefix + "*", limit=1000):
        removed += sum(client.remove_many([k.key for k in listing]))
        if len(listing) < 1000:
            break
    return removed
