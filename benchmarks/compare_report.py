"""The report of benchmarks/compare.py: the side-by-side table, the verdicts on issue 6's targets,
and the chart."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import (
    BATCH_KEYS,
    LIMIT_SUSPECT_RATIO,
    KiB,
    MiB,
    across_runs_if_any,
    judged,
    markdown_table,
    size_label,
    spread_cell,
)
from rawtcp import raw_tcp_spread

#: The workload (compare.py measures it) and issue 6's targets (README, "Performance").
SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB, 32 * MiB)
EXIST_KEYS = 512
MATCH_CHUNKS = (64, 512, 4096)
MATCH_CHUNK_TOKENS = 256
#: Targets of issue 6 that this benchmark measures (README, "Performance").
TCP_VS_MOONCAKE = ((8 * MiB, 32 * MiB), 1.8)  # store tcp x4 get_into / Mooncake's remote get_into
TCP_VS_RAW = ((8 * MiB, 32 * MiB), 0.85)  # store tcp xN get_into / raw loopback TCP get xN
#: Raw TCP connection counts measured as limits: the store's tcp cases' own counts.
RAW_CONNECTIONS = (1, 4)
#: The store's cases: (transport, tcp_connections).
STORE_CASES = (("shm", 4), ("tcp", 4), ("tcp", 1))
BATCH_VS_MOONCAKE = 2.0  # get_many_into of BATCH_KEYS x 64 KiB / Mooncake's batch_get_into
MATCH_TARGET_US = 1000.0  # prefix match of EXIST_KEYS chunks, p50


def raw_connections_of(system: str) -> int:
    """The raw TCP connection count a system is held against: the store's tcp xN cases against raw
    xN (like for like); the others (Mooncake's transport, Redis) against one connection."""
    prefix = "store tcp x"
    return int(system.removeprefix(prefix)) if system.startswith(prefix) else 1


def systems_of(runs: list[dict[str, Any]]) -> list[str]:
    """Every system any run measured, in the order they first appear: a run where one failed (say
    Mooncake) must not hide it from the others' figures, nor crash the report."""
    return list(dict.fromkeys(name for run in runs for name in run.get("systems", {})))


def skipped_runs(runs: list[dict[str, Any]]) -> list[str]:
    """'run K: reason' for each run where Mooncake was not measured."""
    return [f"run {k}: {run['mooncake_skipped']}" for k, run in enumerate(runs, 1) if "mooncake_skipped" in run]


def _unreliable(x: tuple[float, float, float] | None, limit: tuple[float, float, float] | None) -> str:
    """A mark for a figure above its limit: the limit was measured in a slow window."""
    if x is None or limit is None or not limit[0] or x[0] / limit[0] <= LIMIT_SUSPECT_RATIO:
        return ""
    return " (limit unreliable)"


def ratio(a: tuple[float, float, float] | None, b: tuple[float, float, float] | None) -> str:
    if a is None or b is None or not b[0]:
        return "–"
    return f"{a[0] / b[0]:.2f}"


def raw_trial_median(runs: list[dict[str, Any]], op: str, size: int, conns: int = 1) -> float | None:
    """The median over runs of the raw TCP x``conns`` loop with the better median trial: the typical
    figure behind the best-of-trials limit."""
    vals = []
    for run in runs:
        tcp = run["limits"]["tcp"].get(conns)
        if tcp is None:
            continue
        spread = raw_tcp_spread(tcp, op, size)
        loops = [v for k, v in spread.items() if k.endswith("_median")]
        if loops:
            vals.append(max(loops))
    return statistics.median(vals) if vals else None


def report(runs: list[dict[str, Any]], sizes: tuple[int, ...]) -> tuple[str, list[str]]:
    n = len(runs)
    systems = systems_of(runs)
    has_mc = "mooncake tcp" in systems
    raw_conns = sorted({conns for run in runs for conns in run["limits"]["tcp"]})
    lines = []
    for op, title in (("get", "get_into / GET"), ("put", "put / SET")):
        rows = []
        for size in sizes:
            mem = across_runs_if_any(runs, "limits", "memcpy", "cold", size)
            raw = {c: across_runs_if_any(runs, "limits", "tcp", c, op, size) for c in raw_conns}
            mc = across_runs_if_any(runs, "systems", "mooncake tcp", op, size)
            for name in systems:
                x = across_runs_if_any(runs, "systems", name, op, size)
                limit = mem if name == "store shm" else raw.get(raw_connections_of(name))
                rows.append(
                    [
                        size_label(size),
                        name,
                        spread_cell(x, n),
                        ratio(x, limit) + _unreliable(x, limit),
                        ratio(x, mc) if has_mc and name != "mooncake tcp" else "–",
                    ]
                )
            cells = [spread_cell(mem, n)]
            for c in raw_conns:
                typical = raw_trial_median(runs, op, size, c)
                cells.append(spread_cell(raw[c], n) + (f" (median trial {typical:.2f})" if typical else ""))
            rows.append(
                [
                    size_label(size),
                    "_limit: memcpy / " + " / ".join(f"raw TCP x{c}" for c in raw_conns) + "_",
                    " / ".join(cells),
                    "",
                    "",
                ]
            )
        lines.append(f"### {title} throughput, GB/s" + (f" (median, min–max of {n} runs)" if n > 1 else "") + "\n")
        lines.append(
            markdown_table(
                [
                    "size",
                    "system",
                    "GB/s",
                    "x limit (memcpy for shm; raw TCP xN for store tcp xN; raw TCP x1 otherwise)",
                    "x Mooncake",
                ],
                rows,
            )
        )
        lines.append("")
    rows = []
    for name in systems:
        gm = across_runs_if_any(runs, "systems", name, "batch", "get_many_gbps")
        pm = across_runs_if_any(runs, "systems", name, "batch", "put_many_gbps")
        rows.append(
            [
                name,
                spread_cell(pm, n),
                spread_cell(gm, n),
                spread_cell(across_runs_if_any(runs, "systems", name, "batch", "get_many_p50_ms"), n),
                ratio(gm, across_runs_if_any(runs, "systems", "mooncake tcp", "batch", "get_many_gbps"))
                if has_mc
                else "–",
            ]
        )
    lines.append(f"### Batches of {BATCH_KEYS} x 64 KiB (put_many / get_many_into, MSET/MGET, batch_*_into)\n")
    lines.append(markdown_table(["system", "put GB/s", "get GB/s", "get p50 ms", "get x Mooncake"], rows))
    lines.append("")
    rows = []
    for name in systems:
        p50 = across_runs_if_any(runs, "systems", name, "lat", "p50_us")
        rows.append(
            [
                name,
                spread_cell(p50, n, 0),
                spread_cell(across_runs_if_any(runs, "systems", name, "lat", "p99_us"), n, 0),
                ratio(p50, across_runs_if_any(runs, "systems", "mooncake tcp", "lat", "p50_us")) if has_mc else "–",
            ]
        )
    lines.append("### 4 KiB get latency, µs\n")
    lines.append(markdown_table(["system", "p50", "p99", "p50 x Mooncake (lower is better)"], rows))
    ex = across_runs_if_any(runs, "systems", "mooncake tcp", "exist512_p50_us")
    if "prefix" in runs[0]:
        rows = []
        for chunks in MATCH_CHUNKS:
            idx = across_runs_if_any(runs, "prefix", chunks, "index_p50_us")
            rows.append(
                [
                    str(chunks),
                    spread_cell(across_runs_if_any(runs, "prefix", chunks, "match_p50_us"), n, 0),
                    spread_cell(across_runs_if_any(runs, "prefix", chunks, "match_p99_us"), n, 0),
                    spread_cell(across_runs_if_any(runs, "prefix", chunks, "hash_p50_us"), n, 0),
                    spread_cell(idx, n, 0),
                    spread_cell(across_runs_if_any(runs, "prefix", chunks, "index_p99_us"), n, 0),
                    ratio(idx, ex) if ex and chunks == EXIST_KEYS else "–",
                ]
            )
        lines.append(
            f"\n### Prefix match, µs (chains of {MATCH_CHUNK_TOKENS}-token chunks, all stored; "
            f"Mooncake: batch_is_exist of {EXIST_KEYS} keys)\n"
        )
        lines.append(
            markdown_table(
                [
                    "chunks",
                    "match(token ids) p50",
                    "p99",
                    "of which hashing p50",
                    "index call (keys given) p50",
                    "p99",
                    "index call x Mooncake",
                ],
                rows,
            )
        )
    if ex:
        lines.append(f"\nMooncake batch_is_exist of {EXIST_KEYS} keys: p50 {spread_cell(ex, n, 0)} µs.")
    stalls = {
        name: sum(run["systems"].get(name, {}).get("stalls", {}).get("no_capacity", 0) for run in runs)
        for name in systems
    }
    if any(stalls.values()):
        lines.append(
            "\nthis store's puts that hit NoCapacity and waited for the agent to free replaced objects "
            "(inside the timing): " + ", ".join(f"{k} {v}" for k, v in stalls.items() if v)
        )
    skipped = skipped_runs(runs)
    if skipped:
        lines.append(
            f"\nMooncake was not measured in {len(skipped)} of {n} run(s) ({'; '.join(skipped)}); a figure some "
            "run lacks shows as – (every run's figures are in the JSON)."
        )
    return "\n".join(lines), verdicts(runs, systems)


def verdicts(runs: list[dict[str, Any]], systems: list[str]) -> list[str]:
    """The targets of issue 6 this benchmark measures, each met / MISSED / not measured."""

    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    out: list[str] = []
    skipped = skipped_runs(runs)
    no_mc = (
        "not measured (Mooncake skipped in " + ", ".join(s.split(":", 1)[0] for s in skipped) + ": see above)"
        if skipped
        else "not measured (no Mooncake figures)"
    )
    has_mc = "mooncake tcp" in systems
    sizes, want = TCP_VS_MOONCAKE
    for size in sizes:
        tcp = across_runs_if_any(runs, "systems", "store tcp x4", "get", size)
        mc = across_runs_if_any(runs, "systems", "mooncake tcp", "get", size)
        what = f"tcp x4 get_into {size_label(size)} ≥ {want}x Mooncake's remote get_into"
        if tcp is None or mc is None or not has_mc:
            out.append(f"{what}: {no_mc}")
        else:
            out.append(f"{what}: {judged(tcp[0] / mc[0])}x -> {mark(tcp[0] >= want * mc[0])}")
    sizes, want = TCP_VS_RAW
    # The limit of one run is its best raw trial; over several runs, the median of those.
    best = "best trial" if len(runs) == 1 else f"median over {len(runs)} runs of each run's best trial"
    for size in sizes:
        for name in ("store tcp x4", "store tcp x1"):
            conns = raw_connections_of(name)
            raw = across_runs_if_any(runs, "limits", "tcp", conns, "get", size)
            x = across_runs_if_any(runs, "systems", name, "get", size)
            if x is None or raw is None or not raw[0]:
                continue
            # Above its limit, the limit was measured in a slow window: no verdict, as the table says.
            verdict = "not judged (limit unreliable)" if _unreliable(x, raw) else mark(x[0] >= want * raw[0])
            out.append(
                f"{name.removeprefix('store ')} get_into {size_label(size)} ≥ {want}x raw TCP get x{conns} "
                f"({best}, {raw[0]:.2f} GB/s): {judged(x[0] / raw[0])}x -> {verdict}"
            )
    for name in ("store shm", "store tcp x4"):
        what = (
            f"{name.removeprefix('store ')} get_many_into {BATCH_KEYS} x 64 KiB ≥ {BATCH_VS_MOONCAKE}x "
            "Mooncake's batch_get_into"
        )
        gm = across_runs_if_any(runs, "systems", name, "batch", "get_many_gbps")
        mc = across_runs_if_any(runs, "systems", "mooncake tcp", "batch", "get_many_gbps")
        if gm is None or mc is None or not has_mc:
            out.append(f"{what}: {no_mc}")
        else:
            out.append(f"{what}: {judged(gm[0] / mc[0])}x -> {mark(gm[0] >= BATCH_VS_MOONCAKE * mc[0])}")
    for name in ("store shm", "store tcp x4"):
        what = f"{name.removeprefix('store ')} 4 KiB get p50 no worse than Mooncake's remote get"
        p50 = across_runs_if_any(runs, "systems", name, "lat", "p50_us")
        mc = across_runs_if_any(runs, "systems", "mooncake tcp", "lat", "p50_us")
        if p50 is None or mc is None or not has_mc:
            out.append(f"{what}: {no_mc}")
        else:
            out.append(f"{what}: {p50[0]:.0f} vs {mc[0]:.0f} µs ({p50[0] / mc[0]:.2f}x) -> {mark(p50[0] <= mc[0])}")
    idx = across_runs_if_any(runs, "prefix", EXIST_KEYS, "index_p50_us")
    whole = across_runs_if_any(runs, "prefix", EXIST_KEYS, "match_p50_us")
    if idx is not None and whole is not None:
        out.append(
            f"prefix match of {EXIST_KEYS} chunks < {MATCH_TARGET_US / 1000:.0f} ms p50: index call (keys given) "
            f"{idx[0]:.0f} µs -> {mark(idx[0] < MATCH_TARGET_US)}; from token ids {whole[0]:.0f} µs -> "
            f"{mark(whole[0] < MATCH_TARGET_US)}"
        )
    return out


def chart(runs: list[dict[str, Any]], sizes: tuple[int, ...], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install 'mooncake-store[bench]')"
    systems = systems_of(runs)
    raw_conns = sorted({conns for run in runs for conns in run["limits"]["tcp"]})
    limits = 1 + len(raw_conns)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / (len(systems) + limits)
    xs = np.arange(len(sizes))
    for ax, op in zip(axes, ("get", "put"), strict=True):
        series: list[tuple[str, tuple[Any, ...]]] = [("memcpy", ("limits", "memcpy", "cold"))]
        series += [(f"raw TCP x{c}", ("limits", "tcp", c, op)) for c in raw_conns]
        series += [(name, ("systems", name, op)) for name in systems]
        for k, (label, path_) in enumerate(series):
            vals = [(across_runs_if_any(runs, *path_, s) or (0.0, 0.0, 0.0)) for s in sizes]
            ax.bar(
                xs + k * width,
                [v[0] for v in vals],
                width,
                yerr=[[v[0] - v[1] for v in vals], [v[2] - v[0] for v in vals]],
                label=label,
                hatch="//" if k < limits else None,
            )
        ax.set_xticks(xs + width * (len(series) - 1) / 2, [size_label(s) for s in sizes])
        ax.set_yscale("log")
        ax.set_ylabel("GB/s (log)")
        ax.set_title("get_into / GET" if op == "get" else "put / SET")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart written to {path}"
