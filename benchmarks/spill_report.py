"""The spill section of benchmarks/tiers.py's report: the table, and a verdict line per path and
size (the target judged on the median ratio of each burst to raw TCP beside it; see
benchmarks/spill_bench.py for how the figures are taken)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import LIMIT_SUSPECT_RATIO, across_runs, judged, markdown_table, size_label, spread_cell
from rawtcp import raw_tcp_spread
from spill_bench import (
    COMPLETE_SHARE,
    FILL,
    INVALID,
    PATHS,
    SPILL_SIZES,
    SPILL_TARGET,
    SPILL_WATERMARKS,
    burst_complete,
)


def fmt(runs: list[dict[str, Any]], *path: Any, digits: int = 2) -> str:
    return spread_cell(across_runs(runs, *path), len(runs), digits)


def spill_row(
    runs: list[dict[str, Any]], path: str, size: int, conns: list[int], bursts: int, verdicts: list[str]
) -> list[str]:
    """One spill table row (path, size); its verdict line goes to ``verdicts``."""
    _, lw = SPILL_WATERMARKS
    best_raw = max(across_runs(runs, "spill", "raw_tcp", c, "put", size)[0] for c in conns)
    best_shared = max(across_runs(runs, "spill", "raw_tcp_shared", c, "put", size)[0] for c in conns)
    spill = across_runs(runs, "spill", "cases", path, size, "spill_gbps")[0]
    ratio, ratio_shared = spill / best_raw, spill / best_shared
    # The target's figure: each burst over the best raw TCP burst beside it, the median of those.
    paired = across_runs(runs, "spill", "cases", path, size, "median_paired_ratio")[0]
    ok = paired >= SPILL_TARGET

    def typical(key: str) -> float:
        """The typical raw figure behind the best trial: the better loop's median trial."""
        return statistics.median(
            max(
                v
                for k in conns
                for name, v in raw_tcp_spread(run["spill"][key][k], "put", size).items()
                if name.endswith("_median")
            )
            for run in runs
        )

    c = runs[-1]["spill"]["cases"][path][size]
    cases = [run["spill"]["cases"][path][size] for run in runs]
    # What makes the case INVALID: a wrong byte in any burst, a burst that stopped short, or no
    # burst that was both (then there is no figure at all).
    problems = []
    wrong, checked = sum(x["wrong"] for x in cases), sum(x["checked"] for x in cases)
    if wrong:
        problems.append(f"{wrong} of {checked} objects read back from B had wrong bytes")
    short_bursts = sum(x["short_bursts"] for x in cases)
    if short_bursts:
        problems.append(
            f"{short_bursts} of {bursts * len(runs)} bursts moved under {COMPLETE_SHARE:.0%} of what takes A "
            f"to its low watermark ({lw})"
        )
    miscounted = sum(x.get("miscounted_bursts", 0) for x in cases)
    if miscounted:
        problems.append(f"{miscounted} burst(s) whose keyspace events did not account for every object on B")
    if not burst_complete(c):
        left = c["on_a"] * size / c["a_bytes"]
        problems.append(
            f"no complete burst in the last run: the fastest moved {c['moved_bytes'] >> 20} of "
            f"{c['expected_bytes'] >> 20} MiB, A still {left:.0%} full"
        )
    invalid = bool(problems) or not all(x["valid"] for x in cases)
    median_burst = across_runs(runs, "spill", "cases", path, size, "median_burst_gbps")[0]
    memcpy = across_runs(runs, "spill", "memcpy", size)[0]
    if invalid:
        verdict = f"-> {INVALID}: " + ("; ".join(problems) or "a run had no complete, byte-exact burst")
    elif path == "tcp" and paired > LIMIT_SUSPECT_RATIO:
        # Faster than the raw bursts beside it: those ran in a slow window, and judge nothing.
        verdict = f"-> not judged (limit unreliable: above {LIMIT_SUSPECT_RATIO}x raw TCP)"
    elif path == "tcp":
        verdict = f"-> {'met' if ok else 'MISSED'} (≥{SPILL_TARGET})"
    else:
        verdict = f"= {spill / memcpy:.2f}x one thread's memcpy ({memcpy:.2f} GB/s; not the target's path)"
    typical_shared, typical_private = typical("raw_tcp_shared"), typical("raw_tcp")
    beside = across_runs(runs, "spill", "cases", path, size, "median_beside_gbps")[0]
    verdicts.append(
        f"spill {size_label(size)} over {path}: each complete, byte-exact burst over the best raw loopback "
        f"TCP burst of the same bytes beside it (request/ack and streamed, x1 and x{max(conns)}, shared-memory "
        f"buffers, just before and just after), median {judged(paired)}x (those raw bursts' median "
        f"{beside:.2f} GB/s) {verdict}; "
        f"best burst {spill:.2f} GB/s = {ratio_shared:.2f}x raw TCP put's best trial between shared-memory "
        f"buffers ({best_shared:.2f} GB/s), {ratio:.2f}x its best trial between private buffers "
        f"({best_raw:.2f} GB/s); median of those bursts {median_burst:.2f} GB/s = "
        f"{median_burst / typical_shared:.2f}x / {median_burst / typical_private:.2f}x raw TCP's median trial "
        f"({typical_shared:.2f} / {typical_private:.2f})"
    )
    return [
        path,
        size_label(size),
        *(fmt(runs, "spill", "raw_tcp", k, "put", size) for k in conns),
        *(fmt(runs, "spill", "raw_tcp_shared", k, "put", size) for k in conns),
        fmt(runs, "spill", "memcpy", size),
        fmt(runs, "spill", "cases", path, size, "spill_gbps"),
        fmt(runs, "spill", "cases", path, size, "median_burst_gbps"),
        fmt(runs, "spill", "cases", path, size, "after_first_gbps"),
        fmt(runs, "spill", "cases", path, size, "median_beside_gbps"),
        INVALID
        if invalid
        else fmt(runs, "spill", "cases", path, size, "median_paired_ratio")
        + (f" {'met' if ok else 'MISSED'}" if path == "tcp" else ""),
        f"{ratio_shared:.2f} ({ratio:.2f})",
        f"{c['moved_bytes'] >> 20} MiB ({c['moved_objects']}/{c['objects']} obj.)",
        f"{c['t_first_ms']:.0f} / {c['t_last_ms']:.0f} ({c['steps']} steps)",
        f"{c['evictions']}",
        f"{c['checked'] - c['wrong']}/{c['checked']}",
        " ".join(f"{k} {v:.2f}" for k, v in c["cpu_s"].items()),
    ]


def spill_report(runs: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The spill section of the report: its lines, and a verdict line per case."""
    lines: list[str] = []
    verdicts: list[str] = []
    n = len(runs)
    sp = runs[0]["spill"]
    streams = sp["streams"]
    bursts = len(sp["cases"][PATHS[0]][SPILL_SIZES[0]]["bursts_gbps"])
    conns = sorted(sp["raw_tcp"])
    hw, lw = SPILL_WATERMARKS
    lines.append(
        f"### Spill A -> B, the spill path alone (A: {sp['a_bytes'] >> 20} MiB host filled to {FILL:.0%}, pinned, "
        f"watermarks {hw}/{lw}; released at once; GB/s" + (f", median (min–max) of {n} runs" if n > 1 else "") + ")\n"
    )
    lines.append(
        "spill: bytes that arrived on B over the time from the release to the last swap (B's objects counted "
        f"from keyspace events as each swap lands), the best of {bursts} bursts (each a fresh pair of agents, "
        "filled and released) that were complete and byte-exact, as the raw figure is the best of its trials; median "
        "burst: the median of those bursts; "
        "after first: the best burst's rate between the first and the last swap. "
        "Raw beside: just before each burst's release and just after its last swap, raw TCP moves the "
        f"burst's bytes as whole objects of its size, request/ack and streamed, on 1 and on {streams} loopback "
        "connections, between shared-memory buffers; the best of those eight is the burst's limit in its own seconds "
        "(shown: the median over the bursts). Ratio to raw beside: each valid burst over its limit, the "
        "median of those ratios: the target is judged on it. "
        f"A sends over {streams} connection(s) to B. Raw TCP put xN: whole objects of the same size on N loopback "
        "connections at once between two Python processes, same run, the best of a few short trials of a "
        'request/ack loop and a streaming loop, between private buffers (numpy\'s) and, "shared", between '
        "shared-memory buffers (anonymous MAP_SHARED: the kind of memory an agent's arena is), before and after "
        "the cases; the ratio to raw trials is the best burst over the better of x1 and xN between "
        "shared-memory buffers (in brackets: between private ones). memcpy: one "
        "thread's numpy.copyto rotating over 64 MiB of sources (the shm path copies on "
        f"{streams} threads). Path tcp: A sends WRITEs (as to a peer on another host); the target is judged on it. "
        "Path shm: A copies into B's shared arena (its default for a peer on its own host).\n"
    )
    rows = []
    for path in PATHS:
        for size in SPILL_SIZES:
            rows.append(spill_row(runs, path, size, conns, bursts, verdicts))
    lines.append(
        markdown_table(
            [
                "path",
                "size",
                *(f"raw TCP put x{k}" for k in conns),
                *(f"raw TCP put x{k}, shared" for k in conns),
                "memcpy",
                "spill",
                "median burst",
                "after first",
                "raw beside",
                f"ratio to raw beside (≥{SPILL_TARGET})",
                "ratio to raw trials, shared (private)",
                "moved to B",
                "first / last swap, ms",
                "evicted",
                "byte-exact",
                "CPU s in the spill (last run)",
            ],
            rows,
        )
    )
    spread = []
    for key, memory in (("raw_tcp", "private"), ("raw_tcp_shared", "shared")):
        for size in SPILL_SIZES:
            for k in conns:
                sp_k = raw_tcp_spread(runs[-1]["spill"][key][k], "put", size)
                loops = ", ".join(
                    f"{loop} {sp_k[f'{loop}_median']:.2f} (min {sp_k[f'{loop}_min']:.2f})"
                    for loop in ("rr", "stream")
                    if f"{loop}_median" in sp_k
                )
                spread.append(f"{memory} {size_label(size)} x{k}: best {sp_k['best']:.2f}, median trial {loops}")
    lines.append("\nRaw TCP put trials (last run; rr = request/ack, stream = back to back): " + "; ".join(spread))
    lines.append("")
    for size in SPILL_SIZES:
        prof = runs[-1]["spill"].get("profiled", {}).get(size, {}).get("profile")
        if prof and prof.get("stage_pct"):
            stages = ", ".join(f"{k} {v}%" for k, v in prof["stage_pct"].items())
            leaves = ", ".join(f"`{k}` {v}%" for k, v in list(prof["top_leaves_pct"].items())[:8])
            lines.append(
                f"py-spy on A, {size_label(size)} (a separate profiled run, last repeat): of the "
                f"{prof['samples']} samples of the pressure pass and its write streams, by stage: {stages}. "
                f"Leaves: {leaves}.\n"
            )
    return lines, verdicts
