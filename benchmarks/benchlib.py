"""Shared pieces of the benchmarks: the machine's limits, the store workload, bounded loops, tables.

Every measurement loop is bounded both by a count and by seconds; every process started here is
stopped by its PID; every socket is on loopback. Worker functions run in processes started with the
``spawn`` method, so the client under test never shares an interpreter with the agent or the index.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mooncake_cli.bench_checks import check_batch_reads, check_reads, stamp

KiB = 1 << 10
MiB = 1 << 20
GB = 1e9
SIZES = (64 * KiB, 1 * MiB, 8 * MiB, 32 * MiB)


def exit_on_stop_signals() -> None:
    """SIGTERM, SIGHUP and Ctrl-C (SIGINT) raise SystemExit(128 + signal) in the main thread, so that
    a benchmark stopped by any of them still runs its ``finally`` blocks and context exits: the
    children it started (agents, the index, the raw TCP server, Mooncake's processes) are stopped
    by their PIDs, not orphaned. Ctrl-C printed a KeyboardInterrupt traceback, and SIGHUP (a closed
    terminal) ended the process on the spot."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))


def size_label(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


@dataclass(slots=True)
class Budget:
    """A loop bound: at most ``count`` iterations and about ``seconds`` of wall time (at least ``min_count``)."""

    count: int
    seconds: float
    min_count: int = 3


def budget_for(size: int, *, quick: bool, seconds: float | None = None) -> Budget:
    secs = seconds if seconds is not None else (0.6 if quick else 2.0)
    # Enough iterations that a size moves at least ~1-2 GB, capped so small sizes finish too.
    count = int(min(20_000, max(20, (1.0 if quick else 3.0) * GB / size)))
    return Budget(count=count, seconds=secs)


def timed_loop(fn: Callable[[int], Any], budget: Budget, *, warmup: int = 2) -> tuple[int, float, list[float]]:
    """Run ``fn(i)`` until the budget runs out; return (iterations, total seconds, per-call seconds)."""
    for i in range(warmup):
        fn(i)
    times: list[float] = []
    deadline = time.perf_counter() + budget.seconds
    i = 0
    clock = time.perf_counter
    start = clock()
    while i < budget.count and (i < budget.min_count or clock() < deadline):
        t0 = clock()
        fn(i)
        times.append(clock() - t0)
        i += 1
    return i, clock() - start, times


def across_runs_if_any(runs: list[dict[str, Any]], *path: Any) -> tuple[float, float, float] | None:
    """(median, min, max) of the figure at ``path`` over the runs; None when a run lacks it."""
    vals = []
    for run in runs:
        v: Any = run
        for p in path:
            if not isinstance(v, dict) or p not in v:
                return None
            v = v[p]
        vals.append(float(v))
    return statistics.median(vals), min(vals), max(vals)


def across_runs(runs: list[dict[str, Any]], *path: Any) -> tuple[float, float, float]:
    """As across_runs_if_any, for a figure every run has (KeyError names the path otherwise)."""
    stat = across_runs_if_any(runs, *path)
    if stat is None:
        raise KeyError(f"a run has no figure at {path}")
    return stat


def spread_cell(stat: tuple[float, float, float] | None, nruns: int, digits: int = 2) -> str:
    """A table cell: the median, with the range in brackets when there was more than one run."""
    if stat is None:
        return "–"
    if nruns == 1:
        return f"{stat[0]:.{digits}f}"
    return f"{stat[0]:.{digits}f} ({stat[1]:.{digits}f}–{stat[2]:.{digits}f})"


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else 0.0


def percentile_us(times: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(times), q) * 1e6) if times else float("nan")


# ---- machine limits ---------------------------------------------------------------------------
#: Bytes the store benchmark rotates over (its keys) and the limits rotate over too, so that neither
#: the store nor its limit reads a source that sits hot in the last-level cache.
FOOTPRINT_BYTES = 64 * MiB
#: The smallest agent arena (or Mooncake segment) the store workload fits in: its keys rotate over
#: FOOTPRINT_BYTES, and each replacing put holds its new copy while the old one waits to be freed.
MIN_HOST_BYTES = 2 * FOOTPRINT_BYTES


def judged(ratio: float) -> str:
    """A ratio beside its verdict, to two places rounded down: rounded to nearest, 0.849 read
    "0.85x -> MISSED (≥0.85)"."""
    return f"{math.floor(ratio * 100) / 100:.2f}" if math.isfinite(ratio) else f"{ratio}"


def size_arg(text: str) -> int:
    """An argparse type for a size in bytes, with units as the CLI takes them ("1GiB", "512MiB"):
    --host-bytes took plain integers only."""
    import argparse

    from mooncake_store import MooncakeError
    from mooncake_store.config import parse_size

    try:
        return parse_size(text)
    except MooncakeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_host_bytes(parser: Any, host_bytes: int) -> None:
    """``parser.error`` (exit 2) for an arena the workload cannot fit in, or that /dev/shm cannot
    hold (the agent refused it after the limits had been measured, as a traceback), before any
    work starts."""
    if host_bytes < MIN_HOST_BYTES:
        parser.error(
            f"--host-bytes {host_bytes} is too small: the workload rotates over {FOOTPRINT_BYTES >> 20} MiB "
            f"of keys and needs at least {MIN_HOST_BYTES} ({MIN_HOST_BYTES >> 20} MiB)"
        )
    shm = os.statvfs("/dev/shm")
    available = shm.f_bavail * shm.f_frsize
    if host_bytes > available:
        parser.error(f"--host-bytes {host_bytes} is more than /dev/shm has free ({available} B)")


def check_output_file(parser: Any, path: Path | None, flag: str) -> None:
    """``parser.error`` (exit 2) for a file a run would write only at its end (minutes later) and
    could not: a directory, or a folder this user cannot write."""
    if path is None:
        return
    if path.is_dir():
        parser.error(f"{flag} {path} is a directory; name a file")
    if not _writable_under(path):
        parser.error(f"{flag} {path}: cannot write under {_nearest_existing(path)}")


def check_output_dir(parser: Any, path: Path | None, flag: str) -> None:
    """``parser.error`` (exit 2) for a directory to write in that is a file, or cannot be made."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        parser.error(f"{flag} {path} is not a directory")
    if not path.exists() and not _writable_under(path):
        parser.error(f"{flag} {path}: cannot be made under {_nearest_existing(path)}")


def _nearest_existing(path: Path) -> Path:
    """The closest folder above ``path`` that exists (the rest a run would make)."""
    return next((p for p in path.absolute().parents if p.exists()), Path("/"))


def _writable_under(path: Path) -> bool:
    """Whether a file can be made in the closest existing folder: tried, since os.access says yes
    to root everywhere (`--out /proc/x` started the run and failed in its mkdir, a traceback)."""
    folder = _nearest_existing(path)
    if not folder.is_dir():
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def footprint_slots(size: int) -> int:
    return max(2, min(64, FOOTPRINT_BYTES // size))


#: Windows per size of a memcpy limit, the best kept: one short window on a shared machine swung
#: from 6.6 to 18.3 GB/s at 8 MiB within seconds, and a store's copy came out at 1.5x "memcpy".
MEMCPY_TRIALS = 3


def measure_memcpy(
    sizes: tuple[int, ...], *, quick: bool, slots: dict[int, int] | None = None
) -> dict[str, dict[int, float]]:
    """Single-thread numpy.copyto into one preallocated buffer, GB/s per size, the best of
    MEMCPY_TRIALS windows: "hot" copies the same source every time (cache-resident up to the LLC),
    "cold" rotates over as many sources as the store's benchmark rotates keys (``slots`` per size,
    else footprint_slots). "cold" is the limit the ratios use; merge_memcpy keeps the best of a
    measurement before the store's figures and one after."""
    out: dict[str, dict[int, float]] = {"hot": {}, "cold": {}}
    counts = {size: (slots or {}).get(size) or footprint_slots(size) for size in sizes}
    pool = np.ones(max(counts[s] * s for s in sizes) + max(sizes), dtype=np.uint8)
    for size in sizes:
        dst = np.zeros(size, dtype=np.uint8)
        src = pool[:size]
        srcs = [pool[k * size : (k + 1) * size] for k in range(counts[size])]
        for kind, step in (
            ("hot", lambda _i, d=dst, s=src: np.copyto(d, s)),
            ("cold", lambda i, d=dst, ss=srcs: np.copyto(d, ss[i % len(ss)])),
        ):
            best = 0.0
            for _ in range(MEMCPY_TRIALS):
                n, secs, _ = timed_loop(step, budget_for(size, quick=quick))
                best = max(best, gbps(n * size, secs))
            out[kind][size] = best
    return out


def merge_memcpy(*results: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """The best of several measure_memcpy results of the same sizes, per kind and size."""
    return {kind: {size: max(r[kind][size] for r in results) for size in results[0][kind]} for kind in results[0]}


#: A store copy faster than this many times its memcpy limit means the limit was measured in a
#: slow window, not that the store beat a single-thread copy: the ratio is flagged, not "met".
LIMIT_SUSPECT_RATIO = 1.05


def stop_process(proc: Any, timeout_s: float = 5.0) -> None:
    """Stop a multiprocessing.Process by its PID: SIGTERM, then SIGKILL."""
    if proc.pid is None:
        return
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout_s)


def run_in_process(target: Callable[..., None], *args: Any, timeout_s: float = 600.0) -> Any:
    """Run ``target(*args, queue)`` in a spawned process and return what it put on the queue.
    The process is stopped by PID whatever happens."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status, value = queue.get(timeout=1.0)
                break
            except Exception:
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"worker {target.__name__} (pid {proc.pid}) ended or timed out without a result "
                        f"(exit code {proc.exitcode})"
                    ) from None
        if status != "ok":
            raise RuntimeError(f"worker {target.__name__} failed: {value}")
        return value
    finally:
        proc.join(5)
        stop_process(proc)


# ---- the store ----------------------------------------------------------------------------------
@dataclass(slots=True)
class StoreCase:
    transport: str  # "shm" or "tcp"
    tcp_connections: int = 4
    label: str = ""
    results: dict[str, Any] = field(default_factory=dict)


def store_worker(
    redis_url: str,
    namespace: str,
    transport: str,
    tcp_connections: int,
    sizes: tuple[int, ...],
    quick: bool,
    batch: bool,
    queue: Any,
) -> None:
    """Client process: put and get_into throughput per size, 4 KiB get latency, optional batches."""
    try:
        queue.put(("ok", _store_measure(redis_url, namespace, transport, tcp_connections, sizes, quick, batch)))
    except BaseException as exc:
        import traceback

        queue.put(("error", f"{exc!r}\n{traceback.format_exc()}"))


def _store_measure(
    redis_url: str,
    namespace: str,
    transport: str,
    tcp_connections: int,
    sizes: tuple[int, ...],
    quick: bool,
    batch: bool,
) -> dict[str, Any]:
    from mooncake_store import connect

    out: dict[str, Any] = {"put": {}, "get": {}, "lat": {}, "batch": {}}
    stalls: dict[str, int] = {"no_capacity": 0}
    out["stalls"] = stalls
    tag = f"{transport}{tcp_connections}"
    with connect(redis_url, namespace=namespace, transports=(transport,), tcp_connections=tcp_connections) as client:
        for size in sizes:
            src = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
            dst = np.empty(size, dtype=np.uint8)
            # Rotate over a few keys whose total stays well inside the arena (replaced objects are
            # freed by the agent shortly after, since no read lease is held on them during puts).
            nkeys = footprint_slots(size)
            keys = [f"{tag}-{size}-{i}" for i in range(nkeys)]
            wait_for_room(client, (nkeys + 1) * size)
            b = budget_for(size, quick=quick)

            def put(i: int, k: list[str] = keys, s: np.ndarray = src) -> None:
                stamp(s, i % len(k))  # 8 bytes: each key's own value
                put_retrying(client, k[i % len(k)], s, stalls)

            n, secs, _ = timed_loop(put, b)
            out["put"][size] = gbps(n * size, secs)
            stored = min(nkeys, max(n, 2))  # the keys the loop reached (its warm-up puts two)
            n, secs, _ = timed_loop(lambda i, k=keys[:stored], d=dst: client.get_into(k[i % len(k)], d), b)
            out["get"][size] = gbps(n * size, secs)
            check_reads(lambda i, k=keys, d=dst: client.get_into(k[i], d), src, dst, stored, f"{transport} get_into")
            client.remove_many(keys)
        # 4 KiB latency: one key, many gets.
        small = np.arange(4 * KiB, dtype=np.uint8)
        dst = np.empty_like(small)
        client.put(f"{tag}-lat", small)
        _n, _secs, times = timed_loop(
            lambda _i: client.get_into(f"{tag}-lat", dst),
            Budget(count=2000 if quick else 10000, seconds=3.0),
            warmup=50,
        )
        read = lambda: client.get_into(f"{tag}-lat", dst)  # noqa: E731
        check_batch_reads(read, [small], [dst], f"{transport} 4 KiB get_into")
        out["lat"] = {"p50_us": percentile_us(times, 50), "p99_us": percentile_us(times, 99), "n": len(times)}
        _n, _secs, times = timed_loop(
            lambda _i: client.put(f"{tag}-lat", small), Budget(count=1000 if quick else 5000, seconds=3.0), warmup=20
        )
        out["lat"]["put_p50_us"] = percentile_us(times, 50)
        out["lat"]["put_p99_us"] = percentile_us(times, 99)
        client.remove(f"{tag}-lat")
        if batch:
            out["batch"] = _store_batch(client, tag, quick)
    return out


#: Share of an arena a size's keys may find taken before they start: under the agents' default
#: high watermark (0.9), with room for a pressure pass's sample to be off.
ROOM_SHARE = 0.85
#: How long the removed keys of the sizes before may take to be freed: a read lease (5 s by
#: default) and the agent's next reclaim and heartbeat.
ROOM_WAIT_S = 15.0


def wait_for_room(client: Any, needed: int) -> None:
    """Wait (up to ROOM_WAIT_S) until ``needed`` bytes fit in the host arenas under ROOM_SHARE. The
    keys of the size before were removed, but their memory is freed only once the get loop's read
    leases end: the next size's keys, put meanwhile into an arena near --host-bytes' minimum, had
    the agent evict the coldest of them for room, and the get loop read a key that was gone
    (KeyNotFound: 2 of 2 runs at 128 MiB, 1 of 3 at 256 MiB)."""

    def used_and_capacity() -> tuple[int, int]:
        tiers = [t for node in client.stat().live_nodes for t in node.tiers if t.tier == "host"]
        return sum(t.used_bytes for t in tiers), sum(t.capacity_bytes for t in tiers)

    deadline = time.monotonic() + ROOM_WAIT_S
    used, capacity = used_and_capacity()
    while capacity and used + needed > ROOM_SHARE * capacity and time.monotonic() < deadline:
        time.sleep(0.2)
        used, capacity = used_and_capacity()


def put_retrying(client: Any, key: str, value: Any, stalls: dict[str, int], *, timeout_s: float = 10.0) -> None:
    """A put that waits out NoCapacity: replaced objects are freed by the agent a little later (its
    reclaim runs every sync interval), so a fast replace loop can briefly outrun it. Stalls are counted
    and reported, since they are time the store spends waiting, and they stay inside the timing."""
    from mooncake_store import NoCapacity

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.put(key, value)
            return
        except NoCapacity:
            stalls["no_capacity"] += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


BATCH_OBJECT_BYTES = 64 * KiB
BATCH_KEYS = 128


def _store_batch(client: Any, tag: str, quick: bool) -> dict[str, float]:
    """put_many / get_many_into of BATCH_KEYS objects of 64 KiB each (8 MiB per batch)."""
    rng = np.random.default_rng(7)
    values = {f"{tag}-b{i}": rng.integers(0, 255, BATCH_OBJECT_BYTES, dtype=np.uint8) for i in range(BATCH_KEYS)}
    keys = list(values)
    outs = [np.empty(BATCH_OBJECT_BYTES, dtype=np.uint8) for _ in keys]
    total = BATCH_OBJECT_BYTES * BATCH_KEYS
    b = Budget(count=200 if quick else 1000, seconds=0.8 if quick else 2.0)
    n, secs, ptimes = timed_loop(lambda _i: client.put_many(values), b, warmup=1)
    put = gbps(n * total, secs)
    n, secs, gtimes = timed_loop(lambda _i: client.get_many_into(keys, outs), b, warmup=1)
    get = gbps(n * total, secs)
    check_batch_reads(lambda: client.get_many_into(keys, outs), list(values.values()), outs, "get_many_into")
    client.remove_many(keys)
    return {
        "put_many_gbps": put,
        "get_many_gbps": get,
        "put_many_p50_ms": percentile_us(ptimes, 50) / 1e3,
        "get_many_p50_ms": percentile_us(gtimes, 50) / 1e3,
    }


def source_commit() -> str:
    """The commit the benchmark ran from ("+dirty" with local changes), so a figure quoted later
    can be traced to its code; "unknown" outside a git checkout."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def machine_line(info: dict[str, Any] | None = None) -> str:
    """The report's "machine: ..." line: CPU, CPUs, Python, kernel and the commit it ran from."""
    info = info or machine_info()
    return (
        f"machine: {info.get('cpu', '?')}, {info['cpus']} CPUs, Python {info['python']}, "
        f"kernel {info['kernel']}; commit {info['commit']}"
    )


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "commit": source_commit(),
    }
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):  # noqa: SIM115
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    return info


def as_jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): as_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [as_jsonable(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return as_jsonable(asdict(obj))
    if isinstance(obj, float | np.floating):
        # Six significant digits: rounding to decimals would turn a 4 KiB latency in seconds or a
        # slow rate in GB/s into zero.
        return float(f"{float(obj):.6g}")
    return obj


def emit_report(
    title: str,
    setting: str,
    table: str,
    verdicts_heading: str,
    verdicts: list[str],
    *,
    json_path: Path | None,
    payload: dict[str, Any],
) -> dict[str, Any]:
    """Print a benchmark's markdown report (machine line, table, verdicts) and write its raw JSON;
    returns the machine description it printed."""
    info = machine_info()
    print(f"## mooncake-store {title}\n\n{machine_line(info)}; {setting}\n")
    print(table)
    print(f"\n### {verdicts_heading}\n")
    for verdict in verdicts:
        print(f"- {verdict}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(as_jsonable({"machine": info, **payload}), indent=1))
        print(f"\nraw figures written to {json_path}", file=sys.stderr)
    return info


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
