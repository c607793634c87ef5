"""Transfer throughput of mooncake-store against this machine's limits (issue 2, "Performance").

    python benchmarks/transfer.py [--quick] [--repeat N] [--json OUT]

In one run: single-thread memcpy (numpy.copyto), raw loopback TCP between two processes (1 connection
and the store's connection count, both directions), then a LocalCluster with one agent and a client in
a separate process measuring put and get_into for 64 KiB .. 32 MiB over shm and over tcp (tcp with 1
and with 4 connections per peer), plus 4 KiB get latency. Every figure is GB/s and a ratio to its
limit: memcpy of the same size for shm, raw TCP of the same size over the same number of connections
for tcp (``tcp x4`` against raw TCP x4, measured in the same run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    LIMIT_SUSPECT_RATIO,
    SIZES,
    MiB,
    across_runs,
    check_host_bytes,
    check_output_file,
    emit_report,
    exit_on_stop_signals,
    judged,
    markdown_table,
    measure_memcpy,
    merge_memcpy,
    run_in_process,
    size_arg,
    size_label,
    spread_cell,
    store_worker,
)
from rawtcp import STORE_STRIPE_BYTES, measure_limits, merge_raw_tcp, raw_tcp_server, raw_tcp_worker

#: (transport, tcp_connections) cases measured against the store.
CASES = (("shm", 4), ("tcp", 1), ("tcp", 4))
#: Raw TCP connection counts measured as limits: every tcp case's own count.
RAW_CONNECTIONS = tuple(sorted({conns for transport, conns in CASES if transport == "tcp"}))
TARGETS = {  # (transport, op) -> (sizes, minimum ratio to the limit)
    ("shm", "get"): ((8 * MiB, 32 * MiB), 0.8),
    ("tcp", "get"): ((8 * MiB, 32 * MiB), 0.85),
    ("tcp", "put"): ((32 * MiB,), 0.8),
}


def run_once(sizes: tuple[int, ...], *, quick: bool, host_bytes: int, batch: bool = False) -> dict[str, Any]:
    from mooncake_store import LocalCluster

    limits = measure_limits(sizes, quick=quick, connections=RAW_CONNECTIONS)
    store: dict[str, Any] = {}
    with LocalCluster(num_agents=1, host_bytes=host_bytes) as cluster:
        for transport, conns in CASES:
            name = f"{transport}" if transport == "shm" else f"tcp x{conns}"
            store[name] = run_in_process(
                store_worker, cluster.redis_url, cluster.namespace, transport, conns, sizes, quick, batch
            )
    # Raw TCP again after the store's figures (as compare.py does): on a shared machine one window of
    # a few seconds can sit in someone else's burst; the limit is the best trial of both rounds.
    with raw_tcp_server(max(sizes)) as port:
        for conns in RAW_CONNECTIONS:
            later = run_in_process(raw_tcp_worker, port, sizes, conns, quick)
            limits["tcp"][conns] = merge_raw_tcp(limits["tcp"][conns], later)
    limits["memcpy"] = merge_memcpy(limits["memcpy"], measure_memcpy(sizes, quick=quick))  # likewise
    return {"limits": limits, "store": store}


def case_connections(case: str) -> int:
    """The connection count of a tcp case's name ("tcp x4" -> 4)."""
    return int(case.rpartition("x")[2])


def report(runs: list[dict[str, Any]], sizes: tuple[int, ...]) -> tuple[str, list[str]]:
    n = len(runs)
    lines: list[str] = []
    rows = []
    for size in sizes:
        rows.append(
            [
                size_label(size),
                spread_cell(across_runs(runs, "limits", "memcpy", "hot", size), n),
                spread_cell(across_runs(runs, "limits", "memcpy", "cold", size), n),
                spread_cell(across_runs(runs, "limits", "tcp", 1, "get", size), n),
                spread_cell(across_runs(runs, "limits", "tcp", 1, "put", size), n),
                spread_cell(across_runs(runs, "limits", "tcp", 4, "get", size), n),
                spread_cell(across_runs(runs, "limits", "tcp", 4, "put", size), n),
            ]
        )
    lines.append("### Machine limits (GB/s" + (f", median (min–max) of {n} runs" if n > 1 else "") + ")\n")
    lines.append(
        "memcpy hot: same source each time; memcpy (limit): sources rotating over 64 MiB (64 sources below 1 MiB), "
        "as the store's keys do; the best of several windows before and after the store's figures. "
        "Raw TCP: between two processes with the store's socket options, the best of short trials of a "
        "request/response loop and a one-way stream (sendall from / recv_into preallocated buffers), taken "
        "before and after the store's figures; x4 stripes objects over 4 connections above 4 MiB exactly as "
        "the store does.\n"
    )
    lines.append(
        markdown_table(
            [
                "size",
                "memcpy hot",
                "memcpy (limit)",
                "raw TCP get x1",
                "raw TCP put x1",
                "raw TCP get x4",
                "raw TCP put x4",
            ],
            rows,
        )
    )
    lines.append("")
    rows = []
    verdicts: list[str] = []
    for case in runs[0]["store"]:
        transport = "shm" if case == "shm" else "tcp"
        for op in ("put", "get"):
            for size in sizes:
                med, lo, hi = across_runs(runs, "store", case, op, size)
                if transport == "shm":
                    limit, limit_name = across_runs(runs, "limits", "memcpy", "cold", size)[0], "memcpy"
                else:
                    # Like for like: N store connections against N raw connections of the same run.
                    conns = case_connections(case)
                    limit = across_runs(runs, "limits", "tcp", conns, op, size)[0]
                    limit_name = f"raw TCP {op} x{conns}"
                ratio = med / limit if limit else float("nan")
                target = TARGETS.get((transport, op))
                mark = ""
                if target and size in target[0]:
                    ok = ratio >= target[1]
                    mark = f"{'met' if ok else 'MISSED'} (≥{target[1]})"
                    if ratio > LIMIT_SUSPECT_RATIO:
                        mark = f"limit unreliable: above the limit measured ({limit:.2f} GB/s), not a result"
                    verdicts.append(
                        f"{case} {'get_into' if op == 'get' else 'put'} {size_label(size)}: {judged(ratio)}x "
                        f"{limit_name} -> {mark}"
                    )
                rows.append(
                    [
                        case,
                        "get_into" if op == "get" else "put",
                        size_label(size),
                        spread_cell((med, lo, hi), n),
                        limit_name,
                        f"{ratio:.2f}",
                        mark,
                    ]
                )
    lines.append("### Store throughput (client in its own process, 1 agent)\n")
    lines.append(markdown_table(["path", "op", "size", "GB/s", "limit", "ratio", "target"], rows))
    lines.append("")
    rows = []
    for case in runs[0]["store"]:
        rows.append(
            [
                case,
                spread_cell(across_runs(runs, "store", case, "lat", "p50_us"), n, 0),
                spread_cell(across_runs(runs, "store", case, "lat", "p99_us"), n, 0),
                spread_cell(across_runs(runs, "store", case, "lat", "put_p50_us"), n, 0),
                spread_cell(across_runs(runs, "store", case, "lat", "put_p99_us"), n, 0),
            ]
        )
    lines.append("### 4 KiB latency (µs)\n")
    lines.append(markdown_table(["path", "get_into p50", "get_into p99", "put p50", "put p99"], rows))
    lines.append("")
    # Which connection count serves tcp better on this machine.
    if "tcp x1" in runs[0]["store"] and "tcp x4" in runs[0]["store"]:
        parts = []
        for op in ("get", "put"):
            for size in sizes:
                if size < 8 * MiB:
                    continue
                one = across_runs(runs, "store", "tcp x1", op, size)[0]
                four = across_runs(runs, "store", "tcp x4", op, size)[0]
                parts.append(f"{op} {size_label(size)}: x1 {one:.2f} vs x4 {four:.2f} GB/s")
        striped = f"objects above stripe_bytes={size_label(STORE_STRIPE_BYTES)} are striped"
        lines.append(f"tcp_connections 1 vs 4 ({striped}): " + "; ".join(parts))
    stalls = {
        case: sum(run["store"][case].get("stalls", {}).get("no_capacity", 0) for run in runs)
        for case in runs[0]["store"]
    }
    if any(stalls.values()):
        lines.append(
            "\nputs that hit NoCapacity and waited for the agent to free replaced objects (inside the timing): "
            + ", ".join(f"{case} {count}" for case, count in stalls.items())
        )
    return "\n".join(lines), verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter loops (about a third of the time)")
    parser.add_argument("--repeat", type=int, default=1, help="whole runs; tables show median (min–max)")
    parser.add_argument("--json", type=Path, help="write every raw figure to this file")
    parser.add_argument("--host-bytes", type=size_arg, default=1 << 30, help="agent arena size (default 1GiB)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    check_host_bytes(parser, args.host_bytes)
    check_output_file(parser, args.json, "--json")
    exit_on_stop_signals()
    sizes = SIZES
    started = time.monotonic()
    runs = []
    for i in range(args.repeat):
        print(f"run {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
        runs.append(run_once(sizes, quick=args.quick, host_bytes=args.host_bytes))
    table, verdicts = report(runs, sizes)
    emit_report(
        "transfer benchmark",
        f"{args.repeat} run(s), {'quick' if args.quick else 'full'} loops, {time.monotonic() - started:.0f} s",
        table,
        "Targets",
        verdicts,
        json_path=args.json,
        payload={"quick": args.quick, "runs": runs},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
