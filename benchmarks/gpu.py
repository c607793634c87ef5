"""GPU paths (issue 5): the store's device reads and writes against the device's own copy limits,
measured in the same run. Needs cupy and a CUDA device; without them it says why and exits 2.

    python benchmarks/gpu.py [--quick] [--json OUT] [--gpu-mem SIZE]

**Limits** (cupy, one ``cudaMemcpyAsync`` on the legacy stream and a wait, as the store copies):
device to device within the GPU, host to device from pageable numpy memory and device to host into
it, and the same two with page-locked memory (``cudaHostAlloc``).

**Store** (a LocalCluster with one agent, a host arena and a GPU tier of ``--gpu-mem``; the client
in this process, the agent in its own, so every device copy crosses a process boundary through the
agent's CUDA IPC handle or its shared-memory arena):

- ``put`` of a cupy array: into the GPU tier, one device-to-device copy through IPC, against D2D;
- ``get_into`` a cupy array of a GPU-tier object: one device-to-device copy, against D2D;
- ``get_into`` a numpy array of a GPU-tier object: one device-to-host copy, against D2H;
- ``get(key, device="cuda:0")`` of a host-tier object: one host-to-device copy straight out of the
  agent's shared arena, which the client pins on its first device read, against pinned H2D (the
  first read, pinning included, is timed apart);
- the same with a TCP-only client: a TCP read into host memory, then host to device;
- apart from the table: a loader thread's ``get_into`` of a host-tier object into its own stream's
  buffer, on an idle device and with matrix products queued on the legacy default stream. The
  store's copies run on the legacy default stream, which orders them after the caller's work, so
  today the load waits for the products: the figure is what an explicit-stream API would save.

Every store figure includes the index round trips of its operation (a put: RESERVE, put_start and
put_commit; a get: one lookup), which at these sizes can cost more than the copy itself: the
report shows the per-call time next to the bandwidth, so that the two can be told apart. Each
case's bytes are checked once against the source through the case's own path (a read into a zeroed
destination of the case's kind, compared on the host; zeroing is a memset and no kernel is launched,
so the benchmark needs no NVRTC). Loops are bounded by count and seconds; the cluster is stopped by
PID.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import (
    MiB,
    budget_for,
    check_output_file,
    emit_report,
    exit_on_stop_signals,
    gbps,
    markdown_table,
    percentile_us,
    size_label,
    timed_loop,
)

from mooncake_store import LocalCluster, connect
from mooncake_store.tiers.gpu_arrays import cuda_status

SIZES = (1 * MiB, 16 * MiB, 128 * MiB)
QUICK_SIZES = (1 * MiB, 16 * MiB)
#: Objects per size the store cases rotate over (replacing puts free the old copies after a lease).
SLOTS = 4
MEMCPY_DEFAULT = 4
STREAM_LEGACY = 1
#: The store cases, by name (the table's rows, LIMIT_OF's and check_case's keys).
PUT_GPU = "put cupy -> GPU tier"
GET_CUPY_GPU = "get_into cupy <- GPU tier"
GET_NUMPY_GPU = "get_into numpy <- GPU tier"
GET_DEVICE_HOST_SHM = "get(device) <- host tier (shm)"
GET_CUPY_HOST_TCP = "get_into cupy <- host tier (tcp)"
#: Not a case: the cost of the first device read from an agent's arena, which pins it.
PIN = "pin"
#: Not a case: a loader thread's read while the default stream is busy.
OVERLAP = "overlap"
#: The device's own copies: from and to pageable numpy memory, and from and to page-locked memory.
LIMITS = ("d2d", "h2d", "d2h", "h2d pinned", "d2h pinned")


def copy_and_wait(cupy: Any, dst: int, src: int, nbytes: int) -> None:
    cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, STREAM_LEGACY)
    cupy.cuda.runtime.streamSynchronize(STREAM_LEGACY)


def measure(fn: Callable[[int], Any], size: int, *, quick: bool) -> dict[str, float]:
    iters, total, times = timed_loop(fn, budget_for(size, quick=quick))
    return {"gbps": gbps(size * iters, total), "p50_us": percentile_us(times, 50), "iters": iters}


def raw_limits(cupy: Any, sizes: tuple[int, ...], *, quick: bool) -> dict[str, dict[int, dict[str, float]]]:
    out: dict[str, dict[int, dict[str, float]]] = {name: {} for name in LIMITS}
    for size in sizes:
        src, dst = cupy.empty(size, dtype=cupy.uint8), cupy.empty(size, dtype=cupy.uint8)
        host = np.ones(size, dtype=np.uint8)  # touched: page faults stay out of the timing
        pinned_memory = cupy.cuda.alloc_pinned_memory(size)  # cudaHostAlloc: page-locked
        pinned = np.frombuffer(pinned_memory, dtype=np.uint8, count=size)
        pinned[:] = 1
        pairs = {
            "d2d": (dst.data.ptr, src.data.ptr),
            "h2d": (dst.data.ptr, host.ctypes.data),
            "d2h": (host.ctypes.data, src.data.ptr),
            "h2d pinned": (dst.data.ptr, pinned.ctypes.data),
            "d2h pinned": (pinned.ctypes.data, src.data.ptr),
        }
        for name, (d, s) in pairs.items():
            copy = lambda _i, d=d, s=s, n=size: copy_and_wait(cupy, d, s, n)  # noqa: E731
            out[name][size] = measure(copy, size, quick=quick)
        del src, dst, pinned, pinned_memory
    return out


#: Matrix products queued on the default stream for the overlap case (~20 ms each on an H200).
PRODUCTS = 4


def load_during_compute(cupy: Any, client: Any, key: str, size: int) -> dict[str, float]:
    """An engine's pattern: its forward pass queued on the legacy default stream, a loader thread
    pulling a chunk into a buffer of its own non-blocking stream. Times the load with the device
    idle and with PRODUCTS fp32 8192x8192 matrix products queued, and the products alone. (The
    store's copy waits for the products: see the module doc.)"""
    import threading

    a = cupy.zeros((8192, 8192), dtype=cupy.float32)  # memsets: no kernel to compile
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = cupy.zeros(size, dtype=cupy.uint8)
        client.get_into(key, out)  # warm-up
    cupy.cuda.runtime.deviceSynchronize()

    def timed_load() -> float:
        took: list[float] = []

        def load() -> None:
            with stream:
                t0 = time.perf_counter()
                client.get_into(key, out)
                took.append((time.perf_counter() - t0) * 1000)

        worker = threading.Thread(target=load)
        worker.start()
        worker.join(timeout=60)
        return took[0]

    idle_ms = timed_load()
    t0 = time.perf_counter()
    b = a
    for _ in range(PRODUCTS):
        b = b @ a
    cupy.cuda.runtime.deviceSynchronize()
    compute_ms = (time.perf_counter() - t0) * 1000
    for _ in range(PRODUCTS):
        b = b @ a  # queued, not waited for
    busy_ms = timed_load()
    cupy.cuda.runtime.deviceSynchronize()
    return {"size": size, "idle_ms": idle_ms, "busy_ms": busy_ms, "compute_ms": compute_ms}


def first_device_read(cupy: Any, client: Any, key: str) -> dict[str, float]:
    """The first device read of a host-tier object pins the agent's whole arena in this process
    (cudaHostRegister); the next one is an ordinary read. Both are timed once."""
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        client.get(key, device="cuda:0")
        cupy.cuda.runtime.deviceSynchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return {"first_ms": times[0], "next_ms": times[1]}


def store_cases(cupy: Any, sizes: tuple[int, ...], gpu_mem: str, *, quick: bool) -> dict[str, dict[int, Any]]:
    host_bytes = max(256 * MiB, 3 * SLOTS * max(sizes))
    cluster = LocalCluster(1, host_bytes=host_bytes, agent_args=["--gpu-mem", gpu_mem]).start()
    out: dict[str, dict[int, Any]] = {}
    try:
        client = connect(cluster.redis_url, namespace=cluster.namespace, lease_ms=200, timeout_s=30)
        tcp_client = connect(cluster.redis_url, namespace=cluster.namespace, transports=("tcp",), lease_ms=200)
        try:
            for size in sizes:
                rng = np.random.default_rng(size)
                host_src = rng.integers(0, 256, size, dtype=np.uint8)
                dev_src = cupy.asarray(host_src)
                dev_dst = cupy.empty(size, dtype=cupy.uint8)
                host_dst = np.empty(size, dtype=np.uint8)
                gkeys = [f"gpu/{size}/{i}" for i in range(SLOTS)]
                hkeys = [f"host/{size}/{i}" for i in range(SLOTS)]
                cases: dict[str, Callable[[int], Any]] = {
                    PUT_GPU: lambda i, k=gkeys, v=dev_src: client.put(k[i % SLOTS], v),
                    GET_CUPY_GPU: lambda i, k=gkeys, d=dev_dst: client.get_into(k[i % SLOTS], d),
                    GET_NUMPY_GPU: lambda i, k=gkeys, d=host_dst: client.get_into(k[i % SLOTS], d),
                    GET_DEVICE_HOST_SHM: lambda i, k=hkeys: client.get(k[i % SLOTS], device="cuda:0"),
                    GET_CUPY_HOST_TCP: lambda i, k=hkeys, d=dev_dst: tcp_client.get_into(k[i % SLOTS], d),
                }
                for key in hkeys:
                    client.put(key, host_src)
                if PIN not in out:
                    out[PIN] = {"arena_bytes": host_bytes, **first_device_read(cupy, client, hkeys[0])}
                if OVERLAP not in out and (size == sizes[-1] or size >= 16 * MiB):
                    out[OVERLAP] = load_during_compute(cupy, client, hkeys[0], size)
                for name, fn in cases.items():
                    out.setdefault(name, {})[size] = measure(fn, size, quick=quick)
                    gkey = put_check_key(gkeys, int(out[name][size]["iters"])) if name == PUT_GPU else gkeys[0]
                    out[name][size]["exact"] = check_case(cupy, client, tcp_client, name, gkey, hkeys[0], host_src)
                client.remove_many(gkeys + hkeys)
                time.sleep(0.3)  # leases run out; the agent frees the old copies before the next size
        finally:
            tcp_client.close()
            client.close()
    finally:
        cluster.stop()
    return out


def put_check_key(keys: list[str], iters: int) -> str:
    """The key a put case is checked on: the last its timed loop wrote. Every key holds the same
    bytes and the warm-up wrote the first two, so a check of keys[0] passed a put that stored
    nothing after the warm-up (the keys are new for each size)."""
    return keys[min(max(iters, 1), len(keys)) - 1]


def zeroed_device(cupy: Any, nbytes: int) -> Any:
    """A device array of zeros: a read that writes nothing (or only part) then shows as a mismatch.
    ``fill(0)`` of a contiguous cupy array is a memset on the current stream, which the store's copy
    waits for (the array's CUDA Array Interface names that stream); no kernel is compiled."""
    dest = cupy.empty(nbytes, dtype=cupy.uint8)
    dest.fill(0)
    return dest


def check_case(cupy: Any, client: Any, tcp_client: Any, name: str, gkey: str, hkey: str, expected: np.ndarray) -> bool:
    """One read through the case's own path (the client, the destination's kind and the tier of the
    case) into a zeroed destination, compared with the source on the host. A put is read back with
    a host read, a path independent of the device copies under test."""
    if name in (PUT_GPU, GET_CUPY_GPU, GET_NUMPY_GPU):
        tiers = {str(r.tier) for r in client.object_meta(gkey).replicas}
        if tiers != {"gpu"}:
            print(f"  note: {gkey} lives in {tiers}, not the GPU tier", file=sys.stderr)
    if name == PUT_GPU:
        got = np.asarray(client.get(gkey))
    elif name == GET_CUPY_GPU:
        dest = zeroed_device(cupy, expected.size)
        client.get_into(gkey, dest)
        got = cupy.asnumpy(dest)
    elif name == GET_NUMPY_GPU:
        host = np.zeros(expected.size, dtype=np.uint8)
        client.get_into(gkey, host)
        got = host
    elif name == GET_DEVICE_HOST_SHM:
        got = cupy.asnumpy(client.get(hkey, device="cuda:0"))
    elif name == GET_CUPY_HOST_TCP:
        dest = zeroed_device(cupy, expected.size)
        tcp_client.get_into(hkey, dest)
        got = cupy.asnumpy(dest)
    else:
        raise ValueError(f"no check for the case {name!r}")
    return bool(np.array_equal(got, expected))


LIMIT_OF = {
    PUT_GPU: "d2d",
    GET_CUPY_GPU: "d2d",
    GET_NUMPY_GPU: "d2h",
    # The client pins the agent's arena on its first device read: pinned H2D is the limit.
    GET_DEVICE_HOST_SHM: "h2d pinned",
    # TCP lands in a pageable staging buffer, then goes to the device.
    GET_CUPY_HOST_TCP: "h2d",
}


def report(limits: dict[str, Any], store: dict[str, Any], sizes: tuple[int, ...]) -> tuple[str, list[str]]:
    header = ["path", *[size_label(s) for s in sizes]]
    rows = [
        [f"limit {name}", *[f"{limits[name][s]['gbps']:.1f} GB/s, {limits[name][s]['p50_us']:.0f} us" for s in sizes]]
        for name in LIMITS
    ]
    verdicts = []
    pin = store.get(PIN)
    if pin is not None:
        verdicts.append(
            f"first device read of a host-tier object (pins the agent's {size_label(int(pin['arena_bytes']))} "
            f"arena in the client): {pin['first_ms']:.1f} ms; the next: {pin['next_ms']:.1f} ms"
        )
    overlap = store.get(OVERLAP)
    if overlap is not None:
        verdicts.append(
            f"a loader thread's get_into of {size_label(int(overlap['size']))} (host tier, its own stream): "
            f"{overlap['idle_ms']:.2f} ms on an idle device, {overlap['busy_ms']:.2f} ms with "
            f"{overlap['compute_ms']:.0f} ms of matrix products queued on the default stream"
        )
    for name, per_size in store.items():
        if name in (PIN, OVERLAP):
            continue
        cells = []
        for s in sizes:
            fig, limit = per_size[s], limits[LIMIT_OF[name]][s]
            ratio = fig["gbps"] / limit["gbps"] if limit["gbps"] else 0.0
            mark = "" if fig["exact"] else " WRONG BYTES"
            cells.append(f"{fig['gbps']:.1f} GB/s ({ratio:.2f}x {LIMIT_OF[name]}), {fig['p50_us']:.0f} us{mark}")
        rows.append([name, *cells])
        big = sizes[-1]
        exact = all(f["exact"] for f in per_size.values())
        verdicts.append(
            f"{name}: {per_size[big]['gbps'] / max(1e-9, limits[LIMIT_OF[name]][big]['gbps']):.2f}x "
            f"{LIMIT_OF[name]} at {size_label(big)}; bytes {'exact' if exact else 'WRONG'}"
        )
    return markdown_table(header, rows), verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and shorter loops")
    parser.add_argument("--json", type=Path, help="write every raw figure to this file")
    parser.add_argument("--gpu-mem", default="2GiB", help="the agent's GPU tier (default 2GiB)")
    args = parser.parse_args(argv)
    check_output_file(parser, args.json, "--json")
    exit_on_stop_signals()
    usable, why = cuda_status(0)
    if not usable:
        print(f"benchmarks/gpu.py needs cupy and a CUDA device: {why}", file=sys.stderr)
        return 2
    import cupy

    sizes = QUICK_SIZES if args.quick else SIZES
    print(f"device limits ({why}) ...", file=sys.stderr, flush=True)
    limits = raw_limits(cupy, sizes, quick=args.quick)
    print("store paths ...", file=sys.stderr, flush=True)
    store = store_cases(cupy, sizes, args.gpu_mem, quick=args.quick)
    table, verdicts = report(limits, store, sizes)
    emit_report(
        "GPU paths",
        f"{why}; one agent (GPU tier {args.gpu_mem}), client in another process",
        table,
        "Against the device's own limits (same run)",
        verdicts,
        json_path=args.json,
        payload={"device": why, "limits": limits, "store": store},
    )
    exact = all(f["exact"] for name, per in store.items() if name not in (PIN, OVERLAP) for f in per.values())
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
