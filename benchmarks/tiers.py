"""Tiers under pressure (issue 5, "Performance"): spill throughput between two agents against raw
loopback TCP, and the disk tier's codec against plain file I/O, in one run.

    python benchmarks/tiers.py [--quick] [--repeat N] [--json OUT] [--profile DIR] [--disk-dir DIR]
                               [--spill-only]

**Spill** (benchmarks/spill_bench.py, which says how): agent A, filled and pinned past its high
watermark, is released at once and spills to agent B over TCP (the target's path) and over shared
memory; each burst is timed from the release to the last swap and held against raw loopback TCP
moving the same bytes just before and just after it, and against raw TCP trials of the whole run.

**Disk tier** (benchmarks/disk_codec.py, which says how): DiskTier's write and read throughput and
compression ratio, with and without byte-plane shuffling, on the demo model's KV cache and on
random bytes, against plain file writes and reads in the same run and directory. Then, end to end
(here), one agent with ``--disk`` demotes float16 KV chunks under pressure; the demotion rate and
the read-back (disk read, promotion) are reported; a wrong byte read back is INVALID.

Every loop is bounded by a count and by seconds; every process is stopped by its PID (py-spy by
SIGINT to its PID); temporary directories are removed. The exit code is 1 when a figure cannot be
trusted (INVALID: wrong bytes, short bursts), 0 otherwise: a missed target is a result.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import queue as queue_mod
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    GB,
    MiB,
    across_runs,
    check_output_dir,
    check_output_file,
    emit_report,
    exit_on_stop_signals,
    markdown_table,
    size_label,
    stop_process,
)
from disk_codec import CHUNK_TOKENS, kv_chunks, measure_disk, measure_shuffle_kernels
from spill_bench import INVALID, measure_spill
from spill_report import fmt, spill_report

A_HOST_BYTES = 64 * MiB  # the end-to-end demotion case's host arena
WATERMARKS = ("0.5", "0.2")  # the demotion case's


def steady_rate(points: list[tuple[float, int]], size: int, lo: float = 0.1, hi: float = 0.9) -> float:
    """Bytes/s from (time, objects) samples: least-squares slope over the samples between ``lo`` and
    ``hi`` of the final count (the ramp-up and the tail are left out). With fewer than three such
    samples (a quick run's demotions can be over within four polls), the whole run's rate instead:
    the final count over the time from the last sample before the first object to the first
    sample at the final count. 0.0 when nothing moved."""
    if not points or points[-1][1] == 0:
        return 0.0
    final = points[-1][1]
    sel = [(t, n) for t, n in points if lo * final <= n <= hi * final]
    if len(sel) < 3 or sel[-1][0] - sel[0][0] <= 0:
        first = next(i for i, (_, n) in enumerate(points) if n > 0)
        start = points[max(0, first - 1)][0]
        end = next(t for t, n in points if n == final)
        return final * size / (end - start) if end > start else 0.0
    t = np.array([p[0] for p in sel])
    n = np.array([p[1] for p in sel], dtype=float)
    slope = float(np.polyfit(t - t[0], n, 1)[0])
    return slope * size


#: How long the writer waits after its last put before reading back: the agent's demotions go
#: on meanwhile, and the index is polled through it (monotonic clocks are the machine's, shared
#: by the writer's process and this one).
SETTLE_S = 1.5


def demotion_writer(redis_url: str, namespace: str, chunks: list[np.ndarray], copies: int, queue: Any) -> None:
    """Client process: put ``copies`` rounds of float16 KV chunks on D, then read them all back."""
    try:
        from mooncake_store import connect

        arrays = [c.view(np.float16) for c in chunks]
        keys = [f"kv-{r}-{i}" for r in range(copies) for i in range(len(arrays))]
        with connect(redis_url, namespace=namespace) as client:
            t0 = time.monotonic()
            for k, key in enumerate(keys):
                client.put(key, arrays[k % len(arrays)], preferred_node="D")
            t1 = time.monotonic()
            queue.put(("written", {"t_start": t0, "t_end": t1}))
            time.sleep(SETTLE_S)  # let the agent finish demoting before the reads
            meta = [client.object_meta(key) for key in keys]
            on_disk = [key for key, m in zip(keys, meta, strict=True) if m and m.replicas[0].tier == "disk"]
            out = np.empty_like(arrays[0])
            t2 = time.monotonic()
            wrong = 0
            for key in on_disk:
                k = keys.index(key)
                client.get_into(key, out)
                wrong += int(not np.array_equal(out, arrays[k % len(arrays)]))
            t3 = time.monotonic()
            queue.put(("ok", {"read_objects": len(on_disk), "read_s": t3 - t2, "wrong": wrong}))
    except BaseException as exc:
        import traceback

        queue.put(("error", f"{exc!r}\n{traceback.format_exc()}"))


def next_message(queue: Any, timeout_s: float) -> tuple[str, Any] | None:
    """The worker's next (status, value), or None when none came within ``timeout_s``. Only the
    queue's "nothing yet" is caught here: an error the worker reported is for the caller to raise."""
    try:
        status, value = queue.get(timeout=timeout_s)
    except queue_mod.Empty:
        return None
    return status, value


def measure_demotion(chunks: list[np.ndarray], base: Path, *, quick: bool) -> dict[str, Any]:
    """One agent with a disk tier, 64 MiB host arena at 0.5/0.2: puts of float16 KV chunks force
    demotions; rate = bytes whose replica moved to disk per second (index polled), then read back."""
    from mooncake_store import LocalCluster
    from mooncake_store.index.client import RedisIndex

    chunk = len(chunks[0])
    copies = max(1, ((2 if quick else 4) * A_HOST_BYTES) // (chunk * len(chunks)))
    total = copies * len(chunks) * chunk
    disk_dir = base / "agent-disk"
    hw, lw = WATERMARKS
    ctx = mp.get_context("spawn")
    with LocalCluster(num_agents=0, host_bytes=A_HOST_BYTES) as cluster:
        cluster.add_agent(
            node_id="D",
            extra_args=["--disk", str(disk_dir), "--disk-mem", str(4 * total), "--high-watermark", hw,
                        "--low-watermark", lw],
        )  # fmt: skip
        index = RedisIndex(cluster.redis_url, namespace=cluster.namespace)
        queue = ctx.Queue()
        proc = ctx.Process(
            target=demotion_writer, args=(cluster.redis_url, cluster.namespace, chunks, copies, queue), daemon=True
        )
        try:
            proc.start()
            points: list[tuple[float, int]] = []
            written = result = None
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and result is None:
                # Through the writer's settle too: the demotions its last puts caused land then, and
                # a count taken only while it wrote left them out (73 of 116 in a quick run).
                if written is None or time.monotonic() < written["t_end"] + SETTLE_S - 0.1:
                    time.sleep(0.08)  # poll gently: list_keys costs the index server CPU
                    listing = index.list_keys("kv-*")
                    points.append((time.monotonic(), sum(1 for k in listing if k.replicas[0].tier == "disk")))
                message = next_message(queue, 0.02)
                if message is None and not proc.is_alive():
                    message = next_message(queue, 2.0)  # its last message may still be in the pipe
                    if message is None:
                        raise RuntimeError(f"demotion writer (pid {proc.pid}) died, exit code {proc.exitcode}")
                if message is not None:
                    status, value = message
                    if status == "error":  # the writer's own error, with its traceback
                        raise RuntimeError(f"demotion writer failed: {value}")
                    if status == "written":
                        written = value
                    else:
                        result = value
            if result is None or written is None:
                raise RuntimeError("demotion case did not finish within 300 s")
            time.sleep(1.2)  # one heartbeat: the tier counters reach the index
            from mooncake_store import connect

            with connect(cluster.redis_url, namespace=cluster.namespace) as client:
                tiers = {t.tier: t for n in client.stat().nodes for t in n.tiers}
        finally:
            if proc.pid is not None:  # a failed start() must surface as itself, not as join()'s assertion
                proc.join(5)
            stop_process(proc)
            index.close()
    disk = tiers.get("disk")
    return {
        "written_bytes": total,
        "chunk_bytes": chunk,
        "writer_gbps": total / (written["t_end"] - written["t_start"]) / GB,
        "demote_gbps": steady_rate(points, chunk) / GB,
        "demoted_objects": points[-1][1] if points else 0,
        "read_gbps": result["read_objects"] * chunk / result["read_s"] / GB if result["read_s"] else 0.0,
        "read_objects": result["read_objects"],
        "wrong": result["wrong"],
        "demotions": tiers["host"].demotions if "host" in tiers else 0,
        "promotions": disk.promotions if disk else 0,
        "agent_ratio": disk.compression_ratio if disk else 1.0,
    }


# ---- one run ------------------------------------------------------------------------------------
def run_once(
    datasets: dict[str, list[np.ndarray]], base: Path, *, quick: bool, profile_dir: Path | None, e2e: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    print("  spill ...", file=sys.stderr, flush=True)
    out["spill"] = measure_spill(quick=quick, profile_dir=profile_dir)
    if not datasets:  # --spill-only
        return out
    print("  disk tier codec ...", file=sys.stderr, flush=True)
    out["disk"] = measure_disk(datasets, base, quick=quick)
    kv16 = next(v for k, v in datasets.items() if k.startswith("kv float16"))
    out["kernels"] = measure_shuffle_kernels(kv16, quick=quick)
    if e2e:
        print("  disk tier end to end ...", file=sys.stderr, flush=True)
        out["demotion"] = measure_demotion(kv16, base, quick=quick)
    return out


def report(runs: list[dict[str, Any]], kv_info: dict[str, Any]) -> tuple[str, list[str]]:
    lines: list[str] = []
    verdicts: list[str] = []
    n = len(runs)
    spill_lines, verdicts = spill_report(runs)
    lines.extend(spill_lines)
    if "disk" not in runs[0]:  # --spill-only
        return "\n".join(lines), verdicts
    # Disk codec.
    lines.append(
        f"### Disk tier (DiskTier, zstd level 3, xxh3; {kv_info.get('source', '')}; "
        f"chunks of {CHUNK_TOKENS} tokens; GB/s of raw bytes"
        + (f", median (min–max) of {n} runs" if n > 1 else "")
        + ")\n"
    )
    lines.append(
        "encode/decode: in memory (shuffle + zstd + checksum), no files. write: encode + temp file + fsync + "
        "rename. read: read_bytes + decode + checksum (page cache). plain: the same raw bytes written with "
        "write + fsync + rename and read with read_bytes, same run, same directory. Shuffle on for float32 "
        "is 4 planes (shuffle='always'); the tier's default ('auto') shuffles only 2-byte dtypes.\n"
    )
    rows = []
    disk0 = runs[0]["disk"]
    for name in disk0:
        for label in ("off", "on"):
            rows.append(
                [
                    name,
                    size_label(disk0[name]["raw_bytes"]),
                    label,
                    fmt(runs, "disk", name, label, "ratio", digits=3),
                    fmt(runs, "disk", name, label, "encode_gbps"),
                    fmt(runs, "disk", name, label, "decode_gbps"),
                    fmt(runs, "disk", name, label, "write_gbps"),
                    fmt(runs, "disk", name, label, "read_gbps"),
                    fmt(runs, "disk", name, "plain_write_gbps"),
                    fmt(runs, "disk", name, "plain_read_gbps"),
                ]
            )
    lines.append(
        markdown_table(
            ["data", "bytes", "shuffle", "ratio", "encode", "decode", "write", "read", "plain write", "plain read"],
            rows,
        )
    )
    lines.append("")
    k = {name: across_runs(runs, "kernels", name)[0] for name in runs[0]["kernels"]}
    lines.append(
        "Shuffle kernels alone on the float16 KV chunks (GB/s): disk.py's strided uint8 transpose "
        f"shuffle_planes {k['shuffle_planes']:.2f}, unshuffle_planes {k['unshuffle_planes']:.2f}; the same "
        f"planes by uint16 arithmetic (mask/shift into the two halves) {k['shuffle_u16']:.2f} and "
        f"{k['unshuffle_u16']:.2f}.\n"
    )
    # Shuffle verdict on 2-byte data: keep when it saves >= 5% of the disk bytes and costs at most 20%
    # of write and read throughput; "projected" swaps the measured unshuffle for the uint16 kernel.
    for name in disk0:
        if disk0[name]["itemsize"] != 2:
            continue
        r_off, r_on = (
            across_runs(runs, "disk", name, "off", "ratio")[0],
            across_runs(runs, "disk", name, "on", "ratio")[0],
        )
        w_off, w_on = (
            across_runs(runs, "disk", name, "off", "write_gbps")[0],
            across_runs(runs, "disk", name, "on", "write_gbps")[0],
        )
        rd_off, rd_on = (
            across_runs(runs, "disk", name, "off", "read_gbps")[0],
            across_runs(runs, "disk", name, "on", "read_gbps")[0],
        )
        saved = 1 - r_off / r_on
        cheap = w_on >= 0.8 * w_off and rd_on >= 0.8 * rd_off
        # The unshuffle kernel's share of a shuffled decode: how much a faster kernel could win back.
        dec_on = across_runs(runs, "disk", name, "on", "decode_gbps")[0]
        unshuffle_share = min(1.0, dec_on / k["unshuffle_planes"])
        if saved < 0.05:
            kind = "DROP (saves too little)" if name != "random" else "no gain (as expected)"
        elif cheap:
            kind = "KEEP"
        elif unshuffle_share >= 0.5 and k["unshuffle_u16"] >= 4 * k["unshuffle_planes"]:
            kind = "DROP as implemented (re-measure with the uint16 kernels)"
        else:
            kind = "DROP"
        verdicts.append(
            f"shuffle on {name}: ratio {r_off:.3f} -> {r_on:.3f} ({saved * 100:.0f}% fewer disk bytes), "
            f"write {w_off:.2f} -> {w_on:.2f} GB/s, read {rd_off:.2f} -> {rd_on:.2f} GB/s; unshuffle_planes is "
            f"{unshuffle_share * 100:.0f}% of a shuffled decode -> {kind}"
        )
    if "demotion" in runs[-1]:
        d = runs[-1]["demotion"]
        read = sum(run["demotion"]["read_objects"] for run in runs)
        wrong = sum(run["demotion"]["wrong"] for run in runs)
        if wrong:
            state = f"{INVALID}: {wrong} of {read} demoted objects read back with wrong bytes"
        elif not all(run["demotion"]["read_objects"] for run in runs):
            state = f"{INVALID}: a run demoted nothing to read back (the case did not exercise the disk tier)"
        else:
            state = f"{read}/{read} demoted objects read back byte-exact"
        verdicts.append(
            f"disk tier end to end: demotion {fmt(runs, 'demotion', 'demote_gbps')} GB/s, get of demoted "
            f"{fmt(runs, 'demotion', 'read_gbps')} GB/s -> {state}"
        )
        lines.append("### Disk tier end to end (one agent, 64 MiB host at 0.5/0.2, --disk; float16 KV chunks)\n")
        lines.append(
            markdown_table(
                [
                    "written",
                    "writer put",
                    "demotion steady",
                    "demotions",
                    "get of demoted (disk + promote)",
                    "byte-exact",
                    "agent's ratio",
                ],
                [
                    [
                        f"{d['written_bytes'] >> 20} MiB",
                        fmt(runs, "demotion", "writer_gbps"),
                        fmt(runs, "demotion", "demote_gbps"),
                        f"{d['demotions']}",
                        fmt(runs, "demotion", "read_gbps"),
                        f"{d['read_objects'] - d['wrong']}/{d['read_objects']}",
                        f"{d['agent_ratio']:.3f}",
                    ]
                ],
            )
        )
        lines.append("")
    return "\n".join(lines), verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer bytes and passes")
    parser.add_argument("--repeat", type=int, default=1, help="whole runs; tables show median (min–max)")
    parser.add_argument("--json", type=Path, help="write every raw figure to this file")
    parser.add_argument("--profile", type=Path, help="run py-spy on agent A during the spills; stacks go here")
    parser.add_argument("--disk-dir", type=Path, help="parent of the temporary disk-tier directory (default: TMPDIR)")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end demotion case")
    parser.add_argument(
        "--tokens", type=int, help=f"tokens of the KV forward (default 4096, quick 2048; >= {CHUNK_TOKENS})"
    )
    parser.add_argument("--spill-only", action="store_true", help="only the spill cases (no disk tier)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    # 0 is an argument like any other, not "the default"; below one chunk there is no KV data at all.
    tokens = args.tokens if args.tokens is not None else (2048 if args.quick else 4096)
    if tokens < CHUNK_TOKENS:
        parser.error(f"--tokens {tokens}: at least one chunk of {CHUNK_TOKENS} tokens is needed")
    if args.disk_dir is not None and not args.disk_dir.is_dir():
        parser.error(f"--disk-dir {args.disk_dir} is not a directory")
    check_output_file(parser, args.json, "--json")
    check_output_dir(parser, args.profile, "--profile")
    exit_on_stop_signals()
    started = time.monotonic()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    datasets: dict[str, list[np.ndarray]] = {}
    kv_info: dict[str, Any] = {}
    if not args.spill_only:
        print(f"building KV data ({tokens} tokens) ...", file=sys.stderr, flush=True)
        datasets, kv_info = kv_chunks(tokens)
        kv_total = sum(len(c) for c in next(iter(datasets.values())))
        chunk = len(next(iter(datasets.values()))[0])
        rng = np.random.default_rng(3)
        datasets["random"] = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(max(1, kv_total // chunk))]
    base = Path(tempfile.mkdtemp(prefix="mc-tiers-", dir=args.disk_dir))
    runs = []
    try:
        for i in range(args.repeat):
            print(f"run {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            runs.append(run_once(datasets, base, quick=args.quick, profile_dir=args.profile, e2e=not args.no_e2e))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fs = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        df = subprocess.run(["df", "-T", str(base.parent)], capture_output=True, text=True, timeout=10).stdout
        fs = df.splitlines()[1].split()[1]
    table, verdicts = report(runs, kv_info)
    emit_report(
        "tiers benchmark",
        ("spill only; " if args.spill_only else f"disk-tier files on {fs} ({base.parent}); ")
        + f"{args.repeat} run(s), "
        f"{'quick' if args.quick else 'full'}, {time.monotonic() - started:.0f} s",
        table,
        "Targets and decisions",
        verdicts,
        json_path=args.json,
        payload={"quick": args.quick, "kv": kv_info, "filesystem": fs, "runs": runs},
    )
    # Missed targets are results; wrong bytes or short bursts mean the figures cannot be trusted.
    return 1 if any(INVALID in v for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
