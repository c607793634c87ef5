"""Shared pieces of the benchmarks: the machine's limits, the store workload, bounded loops, tables.

Every measurement loop is bounded both by a count and by seconds; every process started here is
stopped by its PID; every socket is on loopback. Worker functions run in processes started with the
``spawn`` method, so the client under test never shares an interpreter with the agent or the index.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import platform
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
GB = 1e9
SIZES = (64 * KiB, 1 * MiB, 8 * MiB, 32 * MiB)
#: Socket buffers for the raw TCP baseline: the same as the store's transport uses.
SOCKET_BUFFER_BYTES = 4 << 20
REQ = struct.Struct("<Q")  # raw protocol: one u64 per request (length; high bit set = put)
PUT_BIT = 1 << 63


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


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else 0.0


def percentile_us(times: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(times), q) * 1e6) if times else float("nan")


# ---- machine limits ---------------------------------------------------------------------------
#: Bytes the store benchmark rotates over (its keys) and the limits rotate over too, so that neither
#: the store nor its limit reads a source that sits hot in the last-level cache.
FOOTPRINT_BYTES = 64 * MiB


def footprint_slots(size: int) -> int:
    return max(2, min(64, FOOTPRINT_BYTES // size))


def measure_memcpy(sizes: tuple[int, ...], *, quick: bool) -> dict[str, dict[int, float]]:
    """Single-thread numpy.copyto into one preallocated buffer, GB/s per size: "hot" copies the same
    source every time (cache-resident up to the LLC), "cold" rotates over FOOTPRINT_BYTES of sources
    as the store's benchmark rotates over its keys. "cold" is the limit the ratios use."""
    out: dict[str, dict[int, float]] = {"hot": {}, "cold": {}}
    pool = np.ones(FOOTPRINT_BYTES + max(sizes), dtype=np.uint8)
    for size in sizes:
        dst = np.zeros(size, dtype=np.uint8)
        src = pool[:size]
        n, secs, _ = timed_loop(lambda _i, d=dst, s=src: np.copyto(d, s), budget_for(size, quick=quick))
        out["hot"][size] = gbps(n * size, secs)
        slots = footprint_slots(size)
        srcs = [pool[k * size : (k + 1) * size] for k in range(slots)]
        n, secs, _ = timed_loop(lambda i, d=dst, ss=srcs: np.copyto(d, ss[i % len(ss)]), budget_for(size, quick=quick))
        out["cold"][size] = gbps(n * size, secs)
    return out


def _raw_server(listener: socket.socket, max_bytes: int, stop: threading.Event) -> None:
    buf = np.ones(FOOTPRINT_BYTES + max_bytes, dtype=np.uint8)  # touched: no zero-page reads
    view = memoryview(buf).cast("B")
    threads = []

    def serve(conn: socket.socket) -> None:
        head = bytearray(REQ.size)
        slot = 0
        with conn:
            while True:
                got = 0
                while got < REQ.size:
                    n = conn.recv_into(memoryview(head)[got:])
                    if n == 0:
                        return
                    got += n
                (word,) = REQ.unpack(head)
                length = word & ~PUT_BIT
                slots = footprint_slots(max(1, length))
                base = (slot % slots) * length  # rotate like the agent's arena does over the keys
                slot += 1
                if word & PUT_BIT:
                    got = 0
                    while got < length:
                        n = conn.recv_into(view[base + got : base + length])
                        if n == 0:
                            return
                        got += n
                    conn.sendall(b"\x01")
                else:
                    conn.sendall(view[base : base + length])

    listener.settimeout(0.5)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            break
        conn.settimeout(None)
        tune(conn)
        t = threading.Thread(target=serve, args=(conn,), daemon=True)
        t.start()
        threads.append(t)


def raw_server_main(port_pipe: Any, max_bytes: int, buffer_bytes: int) -> None:
    """Child process: a plain threaded socket server; sendall from / recv_into a preallocated buffer."""
    global SOCKET_BUFFER_BYTES
    SOCKET_BUFFER_BYTES = buffer_bytes
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port_pipe.send(listener.getsockname()[1])
    port_pipe.close()
    _raw_server(listener, max_bytes, threading.Event())


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def stripes_of(length: int, connections: int, stripe_bytes: int) -> list[tuple[int, int]]:
    """The store's striping rule (transport/tcp.py), so the baseline splits objects the same way."""
    if length <= stripe_bytes or connections == 1:
        return [(0, length)]
    count = min(connections, -(-length // stripe_bytes))
    step = -(-length // count)
    step = -(-step // 4096) * 4096
    return [(start, min(step, length - start)) for start in range(0, length, step)]


class RawClient:
    """Request/response over ``connections`` sockets: a get asks for N bytes and ``recv_into``s them;
    a put ``sendall``s N bytes and waits for a one-byte ack. Large objects are striped like the store's."""

    def __init__(self, port: int, connections: int, stripe_bytes: int = 4 * MiB) -> None:
        self.socks = []
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            tune(s)
            self.socks.append(s)
        self.stripe_bytes = stripe_bytes
        self.pool = None
        if connections > 1:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=connections - 1)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for s in self.socks:
            s.close()

    @staticmethod
    def _get(sock: socket.socket, view: memoryview) -> None:
        sock.sendall(REQ.pack(len(view)))
        got, total = 0, len(view)
        while got < total:
            n = sock.recv_into(view[got:], total - got)
            if n == 0:
                raise ConnectionError("raw server closed")
            got += n

    @staticmethod
    def _put_all(sock: socket.socket, view: memoryview) -> None:
        head = REQ.pack(len(view) | PUT_BIT)
        sent = sock.sendmsg([head, view])
        if sent < len(head):
            sock.sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < len(view):
            sock.sendall(view[sent - len(head) :])
        if sock.recv(1) != b"\x01":
            raise ConnectionError("raw server did not ack")

    def _striped(self, op: Callable[[socket.socket, memoryview], None], view: memoryview) -> None:
        stripes = stripes_of(len(view), len(self.socks), self.stripe_bytes)
        if len(stripes) == 1:
            op(self.socks[0], view)
            return
        assert self.pool is not None
        futs = [self.pool.submit(op, self.socks[k], view[s : s + n]) for k, (s, n) in enumerate(stripes[1:], start=1)]
        s, n = stripes[0]
        op(self.socks[0], view[s : s + n])
        for f in futs:
            f.result()

    def get(self, view: memoryview) -> None:
        self._striped(self._get, view)

    def put(self, view: memoryview) -> None:
        self._striped(self._put_all, view)


@contextlib.contextmanager
def raw_tcp_server(max_bytes: int, buffer_bytes: int = SOCKET_BUFFER_BYTES):  # type: ignore[no-untyped-def]
    """A raw socket server in a spawned child process; yields its port; stops it by PID."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=raw_server_main, args=(child, max_bytes, buffer_bytes), daemon=True)
    proc.start()
    try:
        if not parent.poll(30):
            raise RuntimeError("raw TCP server did not start within 30 s")
        yield parent.recv()
    finally:
        stop_process(proc)


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


def measure_raw_tcp(
    port: int, sizes: tuple[int, ...], connections: int, *, quick: bool, stripe_bytes: int = 4 * MiB
) -> dict[str, dict[int, float]]:
    """GB/s per size for gets (server -> client) and puts (client -> server) over ``connections``."""
    client = RawClient(port, connections, stripe_bytes)
    try:
        res: dict[str, dict[int, float]] = {"get": {}, "put": {}}
        for size in sizes:
            buf = np.ones(size, dtype=np.uint8)
            view = memoryview(buf).cast("B")
            n, secs, _ = timed_loop(lambda _i, v=view: client.get(v), budget_for(size, quick=quick))
            res["get"][size] = gbps(n * size, secs)
            n, secs, _ = timed_loop(lambda _i, v=view: client.put(v), budget_for(size, quick=quick))
            res["put"][size] = gbps(n * size, secs)
        return res
    finally:
        client.close()


def raw_tcp_worker(port: int, sizes: tuple[int, ...], connections: int, quick: bool, queue: Any) -> None:
    try:
        queue.put(("ok", measure_raw_tcp(port, sizes, connections, quick=quick)))
    except BaseException as exc:
        queue.put(("error", repr(exc)))


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


def measure_limits(sizes: tuple[int, ...], *, quick: bool, connections: tuple[int, ...]) -> dict[str, Any]:
    """memcpy per size, and raw loopback TCP gets/puts per size for each connection count, measured
    from a client process talking to a server process (the parent only orchestrates)."""
    memcpy = measure_memcpy(sizes, quick=quick)
    tcp: dict[int, dict[str, dict[int, float]]] = {}
    with raw_tcp_server(max(sizes)) as port:
        for conns in connections:
            tcp[conns] = run_in_process(raw_tcp_worker, port, sizes, conns, quick)
    return {"memcpy": memcpy, "tcp": tcp}


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
            b = budget_for(size, quick=quick)
            n, secs, _ = timed_loop(lambda i, k=keys, s=src: put_retrying(client, k[i % len(k)], s, stalls), b)
            out["put"][size] = gbps(n * size, secs)
            n, secs, _ = timed_loop(lambda i, k=keys, d=dst: client.get_into(k[i % len(k)], d), b)
            out["get"][size] = gbps(n * size, secs)
            if not np.array_equal(src, dst):
                raise RuntimeError(f"{transport} get_into of {size} B returned wrong bytes")
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
    if not all(np.array_equal(values[k], o) for k, o in zip(keys, outs, strict=True)):
        raise RuntimeError("get_many_into returned wrong bytes")
    client.remove_many(keys)
    return {
        "put_many_gbps": put,
        "get_many_gbps": get,
        "put_many_p50_ms": percentile_us(ptimes, 50) / 1e3,
        "get_many_p50_ms": percentile_us(gtimes, 50) / 1e3,
    }


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "kernel": platform.release()}
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
        return round(float(obj), 4)
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
    print(
        f"## mooncake-store {title}\n\nmachine: {info.get('cpu', '?')}, {info['cpus']} CPUs, "
        f"Python {info['python']}, kernel {info['kernel']}; {setting}\n"
    )
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
