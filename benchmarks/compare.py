"""Side by side (issue 6): mooncake-store, the real Mooncake Store, Redis, and the machine's limits.

    python benchmarks/compare.py [--quick] [--repeat N] [--out benchmarks/results]

Same workload for every system, each client in its own process: put and get_into of 4 KiB .. 32 MiB,
batches of 128 x 64 KiB, 4 KiB get latency. Mooncake (PyPI ``mooncake-transfer-engine-non-cuda``) runs
when it imports: this script starts ``mooncake_master`` and a segment server (``mooncake_client``) on
loopback with protocol tcp and P2PHANDSHAKE metadata; the benchmark client contributes no memory, so
its reads cross Mooncake's TCP transport. Redis SET/GET runs on a private EmbeddedServer. Writes a
markdown table, the raw JSON, and (with matplotlib) a PNG chart into the output folder.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    BATCH_KEYS,
    BATCH_OBJECT_BYTES,
    Budget,
    KiB,
    MiB,
    as_jsonable,
    budget_for,
    check_batch_reads,
    check_host_bytes,
    check_output_dir,
    check_reads,
    emit_report,
    exit_on_stop_signals,
    footprint_slots,
    gbps,
    machine_info,
    measure_memcpy,
    merge_memcpy,
    percentile_us,
    run_in_process,
    size_arg,
    stamp,
    store_worker,
    timed_loop,
)
from compare_report import (
    EXIST_KEYS,
    MATCH_CHUNK_TOKENS,
    MATCH_CHUNKS,
    RAW_CONNECTIONS,
    SIZES,
    STORE_CASES,
    chart,
    report,
)
from rawtcp import measure_limits, merge_raw_tcp, raw_tcp_server, raw_tcp_worker


# ---- prefix match -----------------------------------------------------------------------------------
def prefix_worker(redis_url: str, namespace: str, quick: bool, queue: Any) -> None:
    try:
        queue.put(("ok", _prefix_measure(redis_url, namespace, quick)))
    except BaseException as exc:
        import traceback

        queue.put(("error", f"{exc!r}\n{traceback.format_exc()}"))


def _prefix_measure(redis_url: str, namespace: str, quick: bool) -> dict[str, Any]:
    """PrefixCache.match over chains of stored chunks: the whole call from token ids (hashing
    included) and the index call alone on precomputed keys, which is what Mooncake's
    batch_is_exist is handed (engines bring their own block hashes)."""
    from mooncake_store import PrefixCache, connect

    out: dict[str, Any] = {}
    with connect(redis_url, namespace=namespace) as client, PrefixCache(client, "bench/match") as cache:
        tiny = np.zeros(16, np.uint8)
        for n in MATCH_CHUNKS:
            tokens = np.arange(n * MATCH_CHUNK_TOKENS, dtype=np.int64) + 7 * n
            cache.store(tokens, lambda _i: tiny)
            keys = cache.keys(tokens)
            if cache.match(tokens) != n * MATCH_CHUNK_TOKENS:
                raise RuntimeError(f"match of a stored {n}-chunk chain came back short")
            count = (300 if quick else 2000) if n < 4096 else (20 if quick else 100)
            b = Budget(count=count, seconds=1.0 if quick else 3.0)
            _n, _s, whole = timed_loop(lambda _i, t=tokens: cache.match(t), b, warmup=3)
            _n, _s, index = timed_loop(lambda _i, k=keys: cache.index.match(k), b, warmup=3)
            _n, _s, hashing = timed_loop(lambda _i, t=tokens: cache.keys(t), b, warmup=3)
            out[n] = {
                "match_p50_us": percentile_us(whole, 50),
                "match_p99_us": percentile_us(whole, 99),
                "index_p50_us": percentile_us(index, 50),
                "index_p99_us": percentile_us(index, 99),
                "hash_p50_us": percentile_us(hashing, 50),
            }
    return out


# ---- Mooncake ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mooncake_binaries() -> tuple[Path, Path] | str:
    """(mooncake_master, mooncake_client) or the reason Mooncake cannot run here."""
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as exc:
        return (
            f"mooncake is not importable ({exc!r}); install it with "
            "`pip install mooncake-transfer-engine-non-cuda` (needs Debian's libibverbs1)"
        )
    base = Path(mooncake.__file__).parent
    found = []
    for name in ("mooncake_master", "mooncake_client"):
        path = base / name if (base / name).exists() else Path(shutil.which(name) or "")
        if not path.name or not path.exists():
            return f"{name} binary not found next to the mooncake package or on PATH"
        found.append(path)
    return found[0], found[1]


class MooncakeCluster:
    """mooncake_master and one segment server, both on loopback, stopped by PID."""

    def __init__(self, master: Path, segment_server: Path, *, segment_bytes: int, log_dir: Path) -> None:
        self.master_bin, self.client_bin = master, segment_server
        self.segment_bytes = segment_bytes
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.master_addr = ""

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        # The child writes to its own duplicate of the descriptor: ours is closed at once.
        with open(self.log_dir / log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def _wait_log(self, proc: subprocess.Popen[bytes], log: str, needle: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{log} exited with {proc.returncode}: {self.tail(log)}")
            if needle in (self.log_dir / log).read_text(errors="replace"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{log} not ready within {timeout_s} s: {self.tail(log)}")

    def tail(self, log: str) -> str:
        with contextlib.suppress(OSError):
            return (self.log_dir / log).read_text(errors="replace")[-800:]
        return ""

    def start(self) -> MooncakeCluster:
        rpc, metrics = free_port(), free_port()
        self.master_addr = f"127.0.0.1:{rpc}"
        master = self._spawn(
            [
                str(self.master_bin),
                f"--rpc_port={rpc}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={metrics}",
                "--metrics_host=127.0.0.1",
                "--enable_metric_reporting=false",
            ],
            "mooncake_master.log",
        )
        self._wait_log(master, "mooncake_master.log", "Master service started", 20)
        seg = self._spawn(
            [
                str(self.client_bin),
                f"--master_server_address={self.master_addr}",
                "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp",
                "--host=127.0.0.1",
                f"--port={free_port()}",
                f"--global_segment_size={self.segment_bytes}",
            ],
            "mooncake_segment.log",
        )
        self._wait_log(seg, "mooncake_segment.log", "Starting real client service", 30)
        return self

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)


def mooncake_worker(master_addr: str, sizes: tuple[int, ...], quick: bool, queue: Any) -> None:
    try:
        queue.put(("ok", _mooncake_measure(master_addr, sizes, quick)))
    except BaseException as exc:
        import traceback

        queue.put(("error", f"{exc!r}\n{traceback.format_exc()}"))


def _check(rc: Any, what: str) -> None:
    codes = rc if isinstance(rc, list) else [rc]
    bad = [c for c in codes if c < 0]
    if bad:
        raise RuntimeError(f"mooncake {what} failed with code {bad[0]}")


def _mooncake_measure(master_addr: str, sizes: tuple[int, ...], quick: bool) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    # global_segment_size=0: this client holds no data, so every read crosses the TCP transport.
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", master_addr)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    out: dict[str, Any] = {"put": {}, "get": {}, "lat": {}, "batch": {}}
    cap = max(max(sizes), BATCH_KEYS * BATCH_OBJECT_BYTES)
    src = np.random.default_rng(1).integers(0, 255, cap, dtype=np.uint8)
    dst = np.empty(cap, dtype=np.uint8)
    _check(store.register_buffer(src.ctypes.data, src.nbytes), "register_buffer")
    _check(store.register_buffer(dst.ctypes.data, dst.nbytes), "register_buffer")
    sp, dp = src.ctypes.data, dst.ctypes.data
    try:
        for size in sizes:
            keys = [f"mc-{size}-{i}" for i in range(footprint_slots(size))]
            b = budget_for(size, quick=quick)

            def put(i: int, k: list[str] = keys, s: int = size) -> None:
                stamp(src, i % len(k))  # 8 bytes: each key's own value
                _check(store.upsert_from(k[i % len(k)], sp, s), "put")

            n, secs, _ = timed_loop(put, b)
            out["put"][size] = gbps(n * size, secs)

            def get(i: int, k: list[str] = keys, s: int = size) -> None:
                got = store.get_into(k[i % len(k)], dp, s)
                if got != s:
                    raise RuntimeError(f"mooncake get_into returned {got} for {s} B")

            n, secs, times = timed_loop(get, b)
            out["get"][size] = gbps(n * size, secs)
            check_reads(lambda i, k=keys, s=size: get(i, k, s), src[:size], dst[:size], len(keys), "mooncake get_into")
            if size == 4 * KiB:
                _n, _s, times = timed_loop(get, Budget(count=2000 if quick else 10000, seconds=3.0), warmup=50)
                out["lat"] = {"p50_us": percentile_us(times, 50), "p99_us": percentile_us(times, 99)}
                check_reads(lambda i, k=keys, s=size: get(i, k, s), src[:size], dst[:size], len(keys), "mooncake get")
            store.batch_remove(keys, True)
        # Batches: 128 x 64 KiB from/into one registered region.
        keys = [f"mc-b{i}" for i in range(BATCH_KEYS)]
        ptrs_s = [sp + i * BATCH_OBJECT_BYTES for i in range(BATCH_KEYS)]
        ptrs_d = [dp + i * BATCH_OBJECT_BYTES for i in range(BATCH_KEYS)]
        lens = [BATCH_OBJECT_BYTES] * BATCH_KEYS
        total = BATCH_OBJECT_BYTES * BATCH_KEYS
        b = Budget(count=200 if quick else 1000, seconds=0.8 if quick else 2.0)
        n, secs, ptimes = timed_loop(lambda _i: _check(store.batch_upsert_from(keys, ptrs_s, lens), "batch put"), b)
        out["batch"]["put_many_gbps"] = gbps(n * total, secs)
        out["batch"]["put_many_p50_ms"] = percentile_us(ptimes, 50) / 1e3

        def batch_get(_i: int) -> None:
            got = store.batch_get_into(keys, ptrs_d, lens)
            if any(g != BATCH_OBJECT_BYTES for g in got):
                raise RuntimeError(f"mooncake batch_get_into returned {got[:4]}...")

        n, secs, gtimes = timed_loop(batch_get, b)
        out["batch"]["get_many_gbps"] = gbps(n * total, secs)
        out["batch"]["get_many_p50_ms"] = percentile_us(gtimes, 50) / 1e3
        # Once more into a zeroed destination: the loop's warm-up had filled it, so a batch read
        # that wrote nothing after that passed (as the store's own batch check does).
        check_batch_reads(lambda: batch_get(0), [src[:total]], [dst[:total]], "mooncake batch_get_into")
        store.batch_remove(keys, True)
        # batch_is_exist over EXIST_KEYS small keys.
        ekeys = [f"mc-e{i}" for i in range(EXIST_KEYS)]
        _check(store.batch_upsert_from(ekeys, [sp] * EXIST_KEYS, [64] * EXIST_KEYS), "batch put")
        _n, _s, times = timed_loop(
            lambda _i: store.batch_is_exist(ekeys), Budget(count=500 if quick else 2000, seconds=2.0), warmup=5
        )
        out["exist512_p50_us"] = percentile_us(times, 50)
        store.batch_remove(ekeys, True)
    finally:
        store.close()
    return out


# ---- Redis SET/GET ----------------------------------------------------------------------------------
def redis_worker(url: str, sizes: tuple[int, ...], quick: bool, queue: Any) -> None:
    try:
        queue.put(("ok", _redis_measure(url, sizes, quick)))
    except BaseException as exc:
        queue.put(("error", repr(exc)))


def _redis_measure(url: str, sizes: tuple[int, ...], quick: bool) -> dict[str, Any]:
    import redis

    r = redis.Redis.from_url(url)
    out: dict[str, Any] = {"put": {}, "get": {}, "lat": {}, "batch": {}}
    for size in sizes:
        value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
        keys = [f"r-{size}-{i}" for i in range(footprint_slots(size))]
        b = budget_for(size, quick=quick)
        n, secs, _ = timed_loop(lambda i, k=keys, v=value: r.set(k[i % len(k)], v), b)
        out["put"][size] = gbps(n * size, secs)
        n, secs, _ = timed_loop(lambda i, k=keys: r.get(k[i % len(k)]), b)
        out["get"][size] = gbps(n * size, secs)
        if r.get(keys[0]) != value:
            raise RuntimeError("redis GET returned wrong bytes")
        if size == 4 * KiB:
            _n, _s, times = timed_loop(
                lambda _i, k=keys[0]: r.get(k), Budget(count=2000 if quick else 10000, seconds=3.0), warmup=50
            )
            out["lat"] = {"p50_us": percentile_us(times, 50), "p99_us": percentile_us(times, 99)}
        r.delete(*keys)
    rng = np.random.default_rng(9)
    batch = {f"r-b{i}": rng.integers(0, 255, BATCH_OBJECT_BYTES, dtype=np.uint8).tobytes() for i in range(BATCH_KEYS)}
    total = BATCH_OBJECT_BYTES * BATCH_KEYS
    b = Budget(count=200 if quick else 1000, seconds=0.8 if quick else 2.0)
    n, secs, ptimes = timed_loop(lambda _i: r.mset(batch), b)
    out["batch"]["put_many_gbps"] = gbps(n * total, secs)
    out["batch"]["put_many_p50_ms"] = percentile_us(ptimes, 50) / 1e3
    keys = list(batch)
    n, secs, gtimes = timed_loop(lambda _i: r.mget(keys), b)
    out["batch"]["get_many_gbps"] = gbps(n * total, secs)
    out["batch"]["get_many_p50_ms"] = percentile_us(gtimes, 50) / 1e3
    r.delete(*keys)
    r.close()
    return out


# ---- orchestration ----------------------------------------------------------------------------------
def run_once(sizes: tuple[int, ...], *, quick: bool, host_bytes: int, log_dir: Path) -> dict[str, Any]:
    from mooncake_store import LocalCluster
    from mooncake_store.embedded import EmbeddedServer

    limits = measure_limits(sizes, quick=quick, connections=RAW_CONNECTIONS)
    result: dict[str, Any] = {"limits": limits, "systems": {}}
    systems = result["systems"]
    with LocalCluster(num_agents=1, host_bytes=host_bytes) as cluster:
        for transport, conns in STORE_CASES:
            name = "store shm" if transport == "shm" else f"store tcp x{conns}"
            print(f"  {name} ...", file=sys.stderr, flush=True)
            systems[name] = run_in_process(
                store_worker, cluster.redis_url, cluster.namespace, transport, conns, sizes, quick, True
            )
        print("  store prefix match ...", file=sys.stderr, flush=True)
        result["prefix"] = run_in_process(prefix_worker, cluster.redis_url, cluster.namespace, quick)
    bins = mooncake_binaries()
    if isinstance(bins, str):
        print(f"  Mooncake skipped: {bins}", file=sys.stderr, flush=True)
        result["mooncake_skipped"] = bins
    else:
        print("  mooncake tcp ...", file=sys.stderr, flush=True)
        mc = MooncakeCluster(*bins, segment_bytes=host_bytes, log_dir=log_dir)
        try:
            mc.start()
            systems["mooncake tcp"] = run_in_process(mooncake_worker, mc.master_addr, sizes, quick)
        except Exception as exc:
            print(f"  Mooncake failed: {exc}", file=sys.stderr, flush=True)
            result["mooncake_skipped"] = str(exc)
        finally:
            mc.stop()
    print("  redis ...", file=sys.stderr, flush=True)
    with EmbeddedServer() as server:
        systems["redis"] = run_in_process(redis_worker, server.url, sizes, quick)
    # Raw TCP trials again, after the systems: the machine is shared, and a baseline taken in one
    # window of a few seconds can sit in someone else's burst; the limit is the best of both rounds.
    print("  raw TCP again ...", file=sys.stderr, flush=True)
    with raw_tcp_server(max(sizes)) as port:
        for conns in RAW_CONNECTIONS:
            later = run_in_process(raw_tcp_worker, port, sizes, conns, quick)
            limits["tcp"][conns] = merge_raw_tcp(limits["tcp"][conns], later)
    limits["memcpy"] = merge_memcpy(limits["memcpy"], measure_memcpy(sizes, quick=quick))  # likewise
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter loops")
    parser.add_argument("--repeat", type=int, default=1, help="whole runs; tables show median (min–max)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument(
        "--host-bytes", type=size_arg, default=1 << 30, help="arena / Mooncake segment size (default 1GiB)"
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    check_host_bytes(parser, args.host_bytes)
    check_output_dir(parser, args.out, "--out")
    exit_on_stop_signals()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = args.out / f"compare-{stamp}.json"
    info = machine_info()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mc-bench-") as logs:
        for i in range(args.repeat):
            print(f"run {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            runs.append(run_once(SIZES, quick=args.quick, host_bytes=args.host_bytes, log_dir=Path(logs)))
            # The raw figures first, after every run: a later run or the report failing loses nothing.
            json_path.write_text(
                json.dumps(as_jsonable({"machine": info, "quick": args.quick, "runs": runs}), indent=1)
            )
    print(f"raw figures written to {json_path}", file=sys.stderr)
    table, targets = report(runs, SIZES)
    # emit_report prints the report; the same text is kept as the run's markdown file.
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        emit_report(
            "vs Mooncake vs Redis",
            f"{args.repeat} run(s), {'quick' if args.quick else 'full'} loops, {time.monotonic() - started:.0f} s",
            table,
            "Targets",
            targets,
            json_path=None,
            payload={},
        )
    sys.stdout.write(text.getvalue())
    (args.out / f"compare-{stamp}.md").write_text(text.getvalue())
    print(chart(runs, SIZES, args.out / f"compare-{stamp}.png"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
