"""Tiers under pressure (issue 5, "Performance"): spill throughput between two agents against raw
loopback TCP, and the disk tier's codec against plain file I/O, in one run.

    python benchmarks/tiers.py [--quick] [--repeat N] [--json OUT] [--profile DIR] [--disk-dir DIR]
                               [--spill-only]

**Spill.** The spill path alone, with no writer competing: a LocalCluster with agent A (256 MiB host
arena, 1 GiB without --quick; watermarks 0.8/0.1) and agent B (room for everything under A's high
watermark, which is what A's policy checks a peer against). Every object's key is pinned first (a
pin may name a key before it exists), then A is filled to 90% with distinct objects of 1 MiB or 8
MiB (``preferred_node="A"``): past its high watermark, but its pressure passes find nothing movable.
Then all pins are dropped in one Redis round trip and a 1-byte put to A wakes its pressure thread
(a reservation on a node past its high watermark does), and A spills down to its low watermark,
~80% of its arena, in one burst. The parent subscribes to the keyspace events of B's object set
(``notify-keyspace-events``: one event per object a swap adds, delivered as the swap lands, so the
parent does not poll: a SCARD every 2 ms cost ~10 ms of CPU a burst, on the same two CPUs) and
reports the moved bytes over the time from the release to the last swap ("spill"), and between
the first and last swap ("after first"), as a ratio to raw loopback TCP puts of the same size
measured in the same run, before and after the cases (``benchlib.measure_raw_tcp`` with whole
objects from rotating sources on every connection at once, as A's spill streams send them out of
its arena: the best of a few short trials of a request/ack loop and a streaming loop, over 1 and
``spill.STREAMS`` connections, the better of them; the trials' medians are shown too). Target >=
0.7x.

The raw baseline runs twice: between private buffers (numpy's) and between shared-memory buffers
(an anonymous MAP_SHARED mapping on both sides: shmem, the memory an agent's arena is, which it must
be for same-host readers to map it). The target is judged against the shared one. On a kernel that
gives private anonymous memory transparent huge pages but shmem none (``shmem_enabled=never``, the
default), the copies in and out of the socket walk 4 KiB pages instead of 2 MiB ones, and raw TCP
between shared buffers measured ~25-30% below raw TCP between private ones on this machine (medians
of interleaved trials: 5.3 against 7.7 GB/s at 1 MiB on 2 connections). That gap is the memory's,
not the store's: no spill between two arenas can beat raw TCP between shared-memory buffers. The
ratio to the private baseline is shown beside it.

What the spill figure includes, all inside A's pressure pass: reclaim of due graves, the victim
sample (``victims.lua``), the node table read, the placement choice, and per batch of up to
``spill.BATCH_BYTES`` one RESERVE round trip to B, the WRITEs and their acks (``spill.STREAMS``
connections), one compare-and-swap of the batch in the index (``move_replicas.lua``, overlapped with
the next batch's writes) and a FREE of reservations whose swap failed; plus the 1-byte trigger put
(~1 ms) and the delivery of the swap's keyspace events. A's freeing of the old copies (graveyard) is not on that path.
B and the index server share the same CPUs; their CPU seconds during the spill are reported. The
moved objects are read back (a sample of 16) and checked byte for byte. The figure is the best of
the bursts that were complete (moved at least 90% of what takes A to its low watermark) and
byte-exact; a wrong byte or a short burst makes the verdict INVALID and the exit code 1.

**Disk tier.** ``DiskTier`` directly (no agent): every chunk written (encode = optional byte-plane
shuffle + zstd level 3 + xxh3; then temp file, fsync, rename) and read back (read_bytes, zstd,
unshuffle, checksum), with shuffling off and on, against plain files of the same bytes (write,
fsync, rename; read_bytes) in the same run and the same directory. Data: (a) the KV cache of the
demo's tiny random-weight Llama (``mooncake_store.demo.DemoModel``) after a forward over a few
thousand random tokens, cut into the integration's 256-token chunks, as float16, bfloat16 and
float32; (b) random bytes (treated as a 2-byte dtype, so the shuffle runs on them too). Without
torch the KV data are synthetic (float16 normals with per-channel scales) and the table says so.
Reads come from the page cache for both the tier and the plain files (the files were just
written); the tier reads ``1/ratio`` as many bytes from a cold device. Then, end to end, one agent
with ``--disk`` demotes float16 KV chunks under pressure; the demotion rate and the read-back
(disk read, promotion) are reported; a wrong byte read back is INVALID too.

Every loop is bounded by a count and by seconds; every process is stopped by its PID (py-spy by
SIGINT to its PID); temporary directories are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    GB,
    MiB,
    across_runs,
    emit_report,
    exit_on_sigterm,
    markdown_table,
    measure_memcpy,
    merge_raw_tcp,
    raw_tcp_objects_worker,
    raw_tcp_server,
    raw_tcp_spread,
    run_in_process,
    size_label,
    spread_cell,
    stop_process,
)

SPILL_SIZES = (1 * MiB, 8 * MiB)
#: A's spill paths to B: "tcp" (WRITEs; the target is judged on it: a peer on another host gets
#: its bytes so) and "shm" (memcpy into B's shared arena: A's default for a peer on its own host).
PATHS = ("tcp", "shm")
SPILL_TARGET = 0.7
#: The raw TCP baselines: between private buffers, and between shared-memory ones (the memory of
#: an agent's arena). The target is judged on the shared one: see the module doc.
RAW_MEMORIES = ("private", "shared")
#: Spill bursts per size and run (quick, full): each a fresh pair of agents, filled and released.
SPILL_BURSTS = (3, 5)
A_SPILL_BYTES = 1024 * MiB  # agent A's host arena in the spill cases (quick: 256 MiB)
A_SPILL_BYTES_QUICK = 256 * MiB
FILL = 0.9  # A is filled to this fraction of its arena before the release
SETTLE_S = 0.5  # the spill is over once no object has landed on B for this long
#: Objects landing on B closer together than this after a step's first are that step (one swap).
STEP_GAP_S = 0.001
A_HOST_BYTES = 64 * MiB  # the end-to-end demotion case's host arena
WATERMARKS = ("0.5", "0.2")  # the demotion case's
SPILL_WATERMARKS = ("0.8", "0.1")  # A in the spill cases: high, low
CHUNK_TOKENS = 256  # the integration's chunk: (layers, 2, kv_heads, 256, head_dim)
TRIGGER_KEY = "spill-trigger"  # the 1-byte put that wakes A's pressure thread (pinned: never moves)
SPY_RATE = 200
#: A burst that moved less than this share of what takes A to its low watermark stopped short.
COMPLETE_SHARE = 0.9
#: The verdict of a case whose bytes came back wrong or whose bursts stopped short: its figure
#: means nothing, and the exit code is 1.
INVALID = "INVALID"


# ---- helpers ------------------------------------------------------------------------------------
def subscribe_arrivals(index: Any, set_key: str) -> Any:
    """A subscription to the keyspace events of ``set_key`` (one per SADD that added members: a
    batch's swap adds its objects to B's set in one SADD), so that the parent learns of each batch
    landing on B as its swap lands, without polling: a SCARD every 2 ms cost this process ~40 us of
    CPU each (~10 ms a burst, on the two CPUs the spill itself runs on) and the index as many round
    trips. Returns once the server has the subscription."""
    index.redis.config_set("notify-keyspace-events", "Ks")  # keyspace events of set commands
    db = int(index.redis.connection_pool.connection_kwargs.get("db", 0))
    sub = index.redis.pubsub()
    sub.subscribe(f"__keyspace@{db}__:{set_key}")
    deadline = time.monotonic() + 10
    while (msg := sub.get_message(timeout=1.0)) is None or msg["type"] != "subscribe":
        if time.monotonic() > deadline:
            sub.close()
            raise RuntimeError(f"no confirmation of the subscription to {set_key}'s keyspace events")
    return sub


def watch_arrivals(
    sub: Any, t0: float, count_now: Callable[[], int], *, what: str, limit_s: float = 120.0
) -> list[tuple[float, int]]:
    """From ``subscribe_arrivals``: (seconds since ``t0``, members added so far) per step, until
    none has come for SETTLE_S after the first. Each event is followed by ``count_now()`` (a SCARD
    less what was there before), stamped when it returns: never before the members it counts
    landed. Events closer than STEP_GAP_S to a step's first are that step."""
    points: list[tuple[float, int]] = [(0.0, 0)]
    count = 0
    last = time.perf_counter()
    deadline = last + limit_s
    while True:
        msg = sub.get_message(timeout=SETTLE_S)
        if msg is None or msg["type"] != "message" or msg["data"] not in ("sadd", b"sadd"):
            now = time.perf_counter()
            if count and now - last >= SETTLE_S:
                return points
            if now > deadline:
                raise RuntimeError(f"{what} did not settle within {limit_s:g} s ({count} arrived)")
            continue
        counted = count_now()
        now = time.perf_counter()
        if counted <= count:
            continue  # this event's members were counted with an earlier one
        count = counted
        last = now
        if len(points) > 1 and now - t0 - points[-1][0] < STEP_GAP_S:
            points[-1] = (points[-1][0], count)
        else:
            points.append((now - t0, count))


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its reaped children are not counted), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_popen(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Stop a child we started, by its PID: ``sig``, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def steady_rate(points: list[tuple[float, int]], size: int, lo: float = 0.1, hi: float = 0.9) -> float:
    """Bytes/s from (time, objects) samples: least-squares slope over the samples between ``lo`` and
    ``hi`` of the final count (the ramp-up and the tail are left out)."""
    if not points:
        return 0.0
    final = points[-1][1]
    sel = [(t, n) for t, n in points if lo * final <= n <= hi * final]
    if len(sel) < 3 or sel[-1][0] - sel[0][0] <= 0:
        return 0.0
    t = np.array([p[0] for p in sel])
    n = np.array([p[1] for p in sel], dtype=float)
    slope = float(np.polyfit(t - t[0], n, 1)[0])
    return slope * size


# ---- spill --------------------------------------------------------------------------------------
def fill_value(size: int, i: int) -> np.ndarray:
    """Object ``i`` of a case: random bytes (seeded by the size) with ``i`` in the first 8 bytes."""
    value = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    value[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return value


def start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    exe = Path(sys.executable).parent / "py-spy"
    if not exe.exists():
        exe_s = shutil.which("py-spy")
        if exe_s is None:
            return None
        exe = Path(exe_s)
    cmd = [str(exe), "record", "--pid", str(pid), "--format", "raw", "--output", str(out)]
    cmd += ["--rate", str(SPY_RATE), "--idle", "--threads", "--nonblocking"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)  # attach before the release
    return proc


def summarize_profile(path: Path, top: int = 12) -> dict[str, Any]:
    """Collapsed stacks of A's pressure thread and its write streams: share of samples per stage."""
    stages = {
        "victims.lua (sample)": "victim_candidates",
        "index.nodes() (table read)": "nodes (",
        "choose_move/choose_victims": "choose_",
        "RESERVE round trip": "reserve (",
        "TCP WRITE + ack": "write (",
        "move_replicas.lua (batched CAS)": "move_replicas (",
        "move_replica.lua (CAS)": "move_replica (",
        "FREE of leftovers": "free (",
        "reclaim_now / graveyard": "reclaim_now",
        "server_time_ms": "server_time_ms",
    }
    by_stage: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    if not path.exists():
        return {"error": f"py-spy wrote no {path}"}
    for line in path.read_text().splitlines():
        stack, _, n_s = line.rpartition(" ")
        if not n_s.isdigit():
            continue
        n = int(n_s)
        # The pressure pass, or a spill stream thread writing for it (idle pool threads wait in
        # the executor's queue and are left out).
        if "relieve_host" not in stack and not ("mc-spill" in stack and "write (" in stack):
            continue
        total += n
        frames = stack.split(";")
        for name, needle in stages.items():
            if any(needle in f for f in frames):  # the first matching stage wins: no double counting
                by_stage[name] += n
                break
        else:
            by_stage["other"] += n
        leaves[frames[-1].strip()] += n
    return {
        "samples": total,
        "stage_pct": {k: round(100 * v / total, 1) for k, v in by_stage.most_common()} if total else {},
        "top_leaves_pct": {k: round(100 * v / total, 1) for k, v in leaves.most_common(top)} if total else {},
    }


def spill_case(size: int, a_bytes: int, *, path: str, profile_dir: Path | None) -> dict[str, Any]:
    """Fill A (pinned), release, time the one burst of spilling that follows; see the module doc.
    ``path``: how A sends to B, "tcp" (WRITEs, as to a peer on another host) or "shm" (memcpy into
    B's shared arena, A's default for a peer on its host)."""
    from mooncake_store import LocalCluster, connect
    from mooncake_store.index.client import RedisIndex

    count = int(FILL * a_bytes) // size
    hw, lw = SPILL_WATERMARKS
    expected = count * size - int(float(lw) * a_bytes)  # what must leave A to get under its low mark
    # A takes a peer only while the peer stays under A's own high watermark (policy/eviction.py):
    # B has room for everything below that mark.
    b_bytes = int(count * size / float(hw)) + 64 * MiB
    res: dict[str, Any] = {"size": size, "objects": count, "filled_bytes": count * size, "a_bytes": a_bytes}
    keys = [f"spill-{size}-{i}" for i in range(count)]
    with LocalCluster(num_agents=0, host_bytes=a_bytes) as cluster:
        a = cluster.add_agent(
            node_id="A",
            extra_args=[
                "--host-bytes",
                str(a_bytes),
                "--high-watermark",
                hw,
                "--low-watermark",
                lw,
                *(["--no-spill-shm"] if path == "tcp" else []),
            ],
        )
        b = cluster.add_agent(node_id="B", extra_args=["--host-bytes", str(b_bytes)])
        index = RedisIndex(cluster.redis_url, namespace=cluster.namespace)
        spy = None
        arrivals = None
        try:
            with connect(cluster.redis_url, namespace=cluster.namespace, timeout_s=60) as client:
                # Pins first (a pin may name a key before it exists), so that no object can move
                # while A fills past its high watermark: its pressure passes find nothing movable.
                far = index.server_time_ms() + 3_600_000
                pipe = index.redis.pipeline(transaction=False)
                # The trigger put below stays pinned: it must not be counted (or spilled) with the case's objects.
                for key in [*keys, TRIGGER_KEY]:
                    pipe.zadd(index.prefix + "pins:" + key, {"bench": far})
                pipe.execute()
                for i, key in enumerate(keys):
                    client.put(key, fill_value(size, i), preferred_node="A")
                _, per_node, _ = index.counts(["A", "B"])
                if per_node["A"] != count or per_node["B"] != 0:
                    raise RuntimeError(f"fill did not stay on A: {per_node}")
                time.sleep(0.5)  # A's pressure thread idle again, the fill's pages settled
                if profile_dir is not None:
                    spy = start_py_spy(a.pid, profile_dir / profile_name(size))
                pids = {"A": a.pid, "B": b.pid, "index": cluster.server.pid if cluster.server else 0}
                cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
                on_b = index.prefix + "nobj:B"
                # Release every pin in one round trip, then wake A's pressure thread at once with a
                # tiny put (a reservation on a node past its high watermark does) rather than
                # waiting up to one pressure interval.
                arrivals = subscribe_arrivals(index, on_b)
                pipe = index.redis.pipeline(transaction=False)
                pipe.delete(*(index.prefix + "pins:" + key for key in keys))
                t0 = time.perf_counter()
                pipe.execute()
                client.put(TRIGGER_KEY, b"x", preferred_node="A")
                points = watch_arrivals(
                    arrivals, t0, lambda: int(index.redis.scard(on_b)), what=f"spill of {size} B objects"
                )
                arrivals.close()
                # The events must account for every object on B; if not (one lost, or a swap after
                # the watch ended), the burst's figure is not trusted (miscounted_bursts: INVALID).
                on_b_count = int(index.redis.scard(on_b))
                cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
                if spy is not None:
                    stop_popen(spy, signal.SIGINT, timeout_s=20)
                # Byte-exact check of objects now on B, spread over the moved ones.
                ours = (k for k in index.redis.smembers(on_b) if k.startswith(f"spill-{size}-"))
                moved_keys = sorted(ours, key=lambda k: int(k.rsplit("-", 1)[1]))
                sample = [moved_keys[int(j)] for j in np.linspace(0, len(moved_keys) - 1, min(len(moved_keys), 16))]
                out = np.empty(size, dtype=np.uint8)
                wrong = 0
                for key in sample:
                    client.get_into(key, out)
                    wrong += int(not np.array_equal(out, fill_value(size, int(key.rsplit("-", 1)[1]))))
            objects, per_node, counters = index.counts(["A", "B"])
        finally:
            if spy is not None:
                stop_popen(spy, signal.SIGINT, timeout_s=20)
            if arrivals is not None:
                arrivals.close()
            index.close()
    t_first, t_last = points[1][0], points[-1][0]
    moved = points[-1][1] * size
    first_step = points[1][1] * size
    res.update(
        moved_bytes=moved,
        moved_objects=points[-1][1],
        expected_bytes=expected,
        # The figure: every moved byte over the time from the release to the last swap.
        spill_gbps=moved / t_last / GB,
        # After the first swap: the rate of the pass once started (the sample, reclaim and first
        # batch's latency left out); needs two or more steps.
        after_first_gbps=(moved - first_step) / (t_last - t_first) / GB if t_last > t_first else float("nan"),
        t_first_ms=t_first * 1e3,
        t_last_ms=t_last * 1e3,
        steps=len(points) - 1,
        objects_after=objects,
        on_a=per_node["A"],
        on_b=per_node["B"],
        evictions=counters.get("evictions", 0),
        checked=len(sample),
        wrong=wrong,
        on_b_count=on_b_count,
        cpu_s={k: cpu1[k] - cpu0[k] for k in pids},
        timeline=[(round(t * 1e3, 2), n) for t, n in points],
    )
    if profile_dir is not None:
        res["profile"] = summarize_profile(profile_dir / profile_name(size))
    return res


def profile_name(size: int) -> str:
    return f"spill-A-{size_label(size).replace(' ', '')}.txt"


def burst_complete(burst: dict[str, Any]) -> bool:
    """Whether a burst moved what takes A to its low watermark (within COMPLETE_SHARE)."""
    return bool(burst["moved_bytes"] >= COMPLETE_SHARE * burst["expected_bytes"])


def burst_counted(burst: dict[str, Any]) -> bool:
    """Whether the arrivals the burst's figure is made of (keyspace events) are every object on B."""
    counted = burst.get("on_b_count")
    return counted is None or counted == burst.get("moved_objects")


def best_burst(bursts: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of a size's complete, byte-exact bursts, with every burst's figure and the median
    of the valid ones beside it. A short burst's rate is over less work and a wrong burst's bytes
    mean nothing: neither may stand as the figure. With no valid burst the figures are NaN (the
    details are the fastest burst's) and ``valid`` is False. The byte-exact check and the evictions
    count every burst: a wrong byte in a slower burst is not hidden behind the fastest one."""
    good = [b for b in bursts if burst_complete(b) and burst_counted(b) and b["wrong"] == 0]
    best = max(good or bursts, key=lambda b: b["spill_gbps"])
    nan = float("nan")
    wrong = sum(b["wrong"] for b in bursts)
    short = sum(not burst_complete(b) for b in bursts)
    miscounted = sum(not burst_counted(b) for b in bursts)
    return {
        **best,
        **({} if good else {"spill_gbps": nan, "after_first_gbps": nan}),
        "bursts_gbps": [b["spill_gbps"] for b in bursts],
        "valid_bursts": len(good),
        "median_burst_gbps": statistics.median(b["spill_gbps"] for b in good) if good else nan,
        "checked": sum(b["checked"] for b in bursts),
        "wrong": wrong,
        "evictions": sum(b["evictions"] for b in bursts),
        "short_bursts": short,
        "miscounted_bursts": miscounted,
        "valid": bool(good) and wrong == 0 and short == 0 and miscounted == 0,
    }


def measure_spill(*, quick: bool, profile_dir: Path | None) -> dict[str, Any]:
    from mooncake_store.agent.spill import STREAMS

    a_bytes = A_SPILL_BYTES_QUICK if quick else A_SPILL_BYTES
    # Raw TCP between private buffers (numpy's: huge pages where the kernel gives anonymous memory
    # them) and between shared-memory ones (the kind of memory an agent's arena is), each by
    # connection count.
    raw: dict[str, dict[int, Any]] = {memory: {} for memory in RAW_MEMORIES}
    for memory in RAW_MEMORIES:
        shared = memory == "shared"
        with raw_tcp_server(max(SPILL_SIZES), shared=shared) as port:
            for conns in sorted({1, STREAMS}):
                raw[memory][conns] = run_in_process(raw_tcp_objects_worker, port, SPILL_SIZES, conns, quick, shared)
    # Several bursts per size, the sizes taking turns (a noisy second of the shared machine then
    # costs one burst, not one size): the raw limit is the best of several trials, and a single
    # burst held against it would compare one sample with the best of many.
    bursts: dict[str, dict[int, list[dict[str, Any]]]] = {path: {size: [] for size in SPILL_SIZES} for path in PATHS}
    for _ in range(SPILL_BURSTS[not quick]):
        for path in PATHS:
            for size in SPILL_SIZES:
                bursts[path][size].append(spill_case(size, a_bytes, path=path, profile_dir=None))
    cases = {path: {size: best_burst(runs) for size, runs in per_size.items()} for path, per_size in bursts.items()}
    memcpy = measure_memcpy(SPILL_SIZES, quick=quick)["cold"]
    # Raw trials again after the cases (the machine is shared): the limit is the best of both rounds.
    for memory in RAW_MEMORIES:
        shared = memory == "shared"
        with raw_tcp_server(max(SPILL_SIZES), shared=shared) as port:
            for conns in sorted(raw[memory]):
                later = run_in_process(raw_tcp_objects_worker, port, SPILL_SIZES, conns, quick, shared)
                raw[memory][conns] = merge_raw_tcp(raw[memory][conns], later)
    out: dict[str, Any] = {
        "raw_tcp": raw["private"],
        "raw_tcp_shared": raw["shared"],
        "memcpy": memcpy,
        "streams": STREAMS,
        "a_bytes": a_bytes,
        "cases": cases,
    }
    if profile_dir is not None:
        # Separate runs under py-spy, so that the sampler (a process of its own on the same CPUs)
        # does not slow the figures in the table.
        out["profiled"] = {size: spill_case(size, a_bytes, path="tcp", profile_dir=profile_dir) for size in SPILL_SIZES}
    return out


# ---- disk tier ----------------------------------------------------------------------------------
def kv_chunks(tokens: int) -> tuple[dict[str, list[np.ndarray]], dict[str, Any]]:
    """KV chunks of the demo model as uint8 arrays per dtype, plus what they are."""
    try:
        import torch

        from mooncake_store.demo import DemoModel
        from mooncake_store.integrations.transformers import _layers, output_cache
    except ImportError as exc:
        return synthetic_kv(tokens), {"source": f"synthetic float16 normals (torch not importable: {exc})"}
    spec = DemoModel()
    t0 = time.perf_counter()
    model = spec.build()
    ids = torch.randint(0, spec.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids[None], use_cache=True)
    layers = _layers(output_cache(out))
    forward_s = time.perf_counter() - t0
    chunks: dict[str, list[np.ndarray]] = {"kv float16": [], "kv bfloat16": [], "kv float32": []}
    for i in range(tokens // CHUNK_TOKENS):
        s = slice(i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS)
        with torch.no_grad():
            c = torch.stack([torch.stack((k[0, :, s, :], v[0, :, s, :])) for k, v in layers]).contiguous()
        chunks["kv float32"].append(c.numpy().view(np.uint8).reshape(-1).copy())
        chunks["kv float16"].append(c.to(torch.float16).numpy().view(np.uint8).reshape(-1).copy())
        chunks["kv bfloat16"].append(c.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(-1).copy())
    shape = tuple(layers[0][0].shape)
    info = {
        "source": f"demo Llama (random weights, seed {spec.seed}), forward over {tokens} random tokens",
        "torch": torch.__version__,
        "per_layer_kv_shape": shape,
        "layers": len(layers),
        "forward_s": round(forward_s, 2),
    }
    return chunks, info


def synthetic_kv(tokens: int) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(1)
    layers, kv_heads, head_dim = 8, 4, 32
    scale = rng.lognormal(0, 1, (layers, 2, kv_heads, 1, head_dim)).astype(np.float32)
    out: list[np.ndarray] = []
    for _ in range(tokens // CHUNK_TOKENS):
        c = (rng.standard_normal((layers, 2, kv_heads, CHUNK_TOKENS, head_dim), dtype=np.float32) * scale).astype(
            np.float16
        )
        out.append(c.view(np.uint8).reshape(-1))
    return {"kv float16 (synthetic)": out}


ITEMSIZE = {"kv float16": 2, "kv bfloat16": 2, "kv float32": 4, "kv float16 (synthetic)": 2, "random": 2}


def plain_io(chunks: list[np.ndarray], root: Path) -> tuple[float, float]:
    """Plain files of the same bytes: write + fsync + rename, then read_bytes; seconds each."""
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i, c in enumerate(chunks):
        tmp, path = root / f"{i}.tmp", root / f"{i}.bin"
        with open(tmp, "wb") as f:
            f.write(memoryview(c))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    t1 = time.perf_counter()
    total = 0
    for i in range(len(chunks)):
        total += len((root / f"{i}.bin").read_bytes())
    t2 = time.perf_counter()
    shutil.rmtree(root)
    return t1 - t0, t2 - t1


def check_chunks(chunks: list[np.ndarray], got: list[np.ndarray], what: str) -> None:
    """RuntimeError naming the first chunk whose bytes differ from the source."""
    for i, (c, g) in enumerate(zip(chunks, got, strict=True)):
        if not np.array_equal(c, g):
            raise RuntimeError(f"{what} returned wrong bytes (chunk {i} of {len(chunks)})")


def tier_io(chunks: list[np.ndarray], root: Path, itemsize: int, shuffle: str) -> dict[str, float]:
    """DiskTier: in-memory encode/decode (the codec alone), then write + read through files."""
    from mooncake_store.tiers.disk import DiskTier

    # Room for every chunk even if the codec gained nothing, and no more: the tier refuses a
    # capacity its filesystem could never hold.
    tier = DiskTier(root, 2 * sum(len(c) for c in chunks) + 64 * MiB, shuffle=shuffle)
    try:
        warm = tier.encode(memoryview(chunks[0]), itemsize=itemsize)[0]  # contexts and first-touch out of the timing
        tier.decode_into(warm, memoryview(np.empty_like(chunks[0])), where="warm-up")
        t0 = time.perf_counter()
        blobs = [tier.encode(memoryview(c), itemsize=itemsize)[0] for c in chunks]
        t1 = time.perf_counter()
        dest = [np.empty_like(c) for c in chunks]
        for blob, d in zip(blobs, dest, strict=True):
            tier.decode_into(blob, memoryview(d), where="memory")
        t2 = time.perf_counter()
        check_chunks(chunks, dest, f"DiskTier encode/decode (shuffle={shuffle})")
        stored = sum(len(b) for b in blobs)
        del blobs
        for d in dest:  # what the check after the reads sees must come from the reads, not the decode
            d.fill(0)
        for i, c in enumerate(chunks):
            tier.write(i, memoryview(c), itemsize=itemsize)
        t3 = time.perf_counter()
        for i, d in enumerate(dest):
            tier.read_into(i, memoryview(d))
        t4 = time.perf_counter()
        check_chunks(chunks, dest, f"DiskTier write/read (shuffle={shuffle})")
        return {"stored": stored, "encode_s": t1 - t0, "decode_s": t2 - t1, "write_s": t3 - t2, "read_s": t4 - t3}
    finally:
        tier.close()
        shutil.rmtree(root, ignore_errors=True)


def shuffle_u16(data: np.ndarray) -> np.ndarray:
    """The byte planes of 2-byte elements by integer arithmetic on a uint16 view (what disk.py could
    do instead of a strided uint8 transpose); same output as ``shuffle_planes(data, 2)`` for even sizes."""
    v = data.view(np.uint16)
    out = np.empty(len(data), dtype=np.uint8)
    np.bitwise_and(v, 0xFF, out=out[: len(v)], casting="unsafe")
    np.right_shift(v, 8, out=out[len(v) :], casting="unsafe")
    return out


def unshuffle_u16(planes: np.ndarray, out: np.ndarray) -> None:
    half = len(planes) // 2
    o = out.view(np.uint16)
    np.left_shift(planes[half:], 8, out=o, dtype=np.uint16)
    np.bitwise_or(o, planes[:half], out=o)


def measure_shuffle_kernels(chunks: list[np.ndarray], *, quick: bool) -> dict[str, float]:
    """GB/s of disk.py's shuffle_planes/unshuffle_planes against the uint16-arithmetic kernels."""
    from mooncake_store.tiers.disk import shuffle_planes, unshuffle_planes

    raw = sum(len(c) for c in chunks)
    outs = [np.empty_like(c) for c in chunks]
    res: dict[str, float] = {}
    planes_cur = [shuffle_planes(c, 2) for c in chunks]
    planes_u16 = [shuffle_u16(c) for c in chunks]
    if not all(np.array_equal(a, b) for a, b in zip(planes_cur, planes_u16, strict=True)):
        raise RuntimeError("shuffle_u16 disagrees with shuffle_planes")
    kernels = {
        "shuffle_planes": lambda: [shuffle_planes(c, 2) for c in chunks],
        "unshuffle_planes": lambda: [unshuffle_planes(p, 2, o) for p, o in zip(planes_cur, outs, strict=True)],
        "shuffle_u16": lambda: [shuffle_u16(c) for c in chunks],
        "unshuffle_u16": lambda: [unshuffle_u16(p, o) for p, o in zip(planes_u16, outs, strict=True)],
    }
    reps = 3 if quick else 10
    for name, fn in kernels.items():
        if name.startswith("unshuffle"):
            # Both unshuffle kernels write into the same outs: zero them, so that each kernel's own
            # warm-up call is what the check sees.
            for o in outs:
                o.fill(0)
            fn()
            check_chunks(chunks, outs, name)
        else:
            fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        res[name] = raw * reps / (time.perf_counter() - t0) / GB
    return res


def measure_disk(datasets: dict[str, list[np.ndarray]], base: Path, *, quick: bool) -> dict[str, Any]:
    passes = 3 if quick else 5
    out: dict[str, Any] = {}
    for name, chunks in datasets.items():
        raw = sum(len(c) for c in chunks)
        itemsize = ITEMSIZE[name]
        modes = ["never", "always"]
        row: dict[str, Any] = {
            "raw_bytes": raw,
            "chunks": len(chunks),
            "chunk_bytes": len(chunks[0]),
            "itemsize": itemsize,
        }
        plain_w, plain_r = [], []
        per_mode: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        deadline = time.monotonic() + (20 if quick else 60)
        for p in range(passes):
            w, r = plain_io(chunks, base / f"plain-{p}")
            plain_w.append(w)
            plain_r.append(r)
            for m in modes:
                per_mode[m].append(tier_io(chunks, base / f"tier-{m}-{p}", itemsize, m))
            if time.monotonic() > deadline:
                break
        row["plain_write_gbps"] = raw / statistics.median(plain_w) / GB
        row["plain_read_gbps"] = raw / statistics.median(plain_r) / GB
        for m in modes:
            runs = per_mode[m]
            label = "off" if m == "never" else "on"
            row[label] = {
                "ratio": raw / runs[0]["stored"],
                **{
                    f"{k}_gbps": raw / statistics.median(r[f"{k}_s"] for r in runs) / GB
                    for k in ("encode", "decode", "write", "read")
                },
            }
        out[name] = row
    return out


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
            time.sleep(1.5)  # let the agent finish demoting before the reads
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
                if written is None:
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
    ok = ratio_shared >= SPILL_TARGET

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
    elif path == "tcp":
        verdict = f"-> {'met' if ok else 'MISSED'} (≥{SPILL_TARGET})"
    else:
        verdict = f"= {spill / memcpy:.2f}x one thread's memcpy ({memcpy:.2f} GB/s; not the target's path)"
    typical_shared, typical_private = typical("raw_tcp_shared"), typical("raw_tcp")
    verdicts.append(
        f"spill {size_label(size)} over {path}: best complete, byte-exact burst {spill:.2f} GB/s = "
        f"{ratio_shared:.2f}x raw loopback TCP put's best trial between shared-memory buffers "
        f"({best_shared:.2f} GB/s) {verdict}, {ratio:.2f}x its best trial between private buffers "
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
        INVALID
        if invalid
        else f"{ratio_shared:.2f}" + (f" {'met' if ok else 'MISSED'}" if path == "tcp" else "") + f" ({ratio:.2f})",
        f"{c['moved_bytes'] >> 20} MiB ({c['moved_objects']}/{c['objects']} obj.)",
        f"{c['t_first_ms']:.0f} / {c['t_last_ms']:.0f} ({c['steps']} steps)",
        f"{c['evictions']}",
        f"{c['checked'] - c['wrong']}/{c['checked']}",
        " ".join(f"{k} {v:.2f}" for k, v in c["cpu_s"].items()),
    ]


def report(runs: list[dict[str, Any]], kv_info: dict[str, Any]) -> tuple[str, list[str]]:
    lines: list[str] = []
    verdicts: list[str] = []
    n = len(runs)
    # Spill.
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
        f"A sends over {streams} connection(s) to B. Raw TCP put xN: whole objects of the same size on N loopback "
        "connections at once between two Python processes, same run, the best of a few short trials of a "
        'request/ack loop and a streaming loop, between private buffers (numpy\'s) and, "shared", between '
        "shared-memory buffers (anonymous MAP_SHARED: the kind of memory an agent's arena is); the ratio is to "
        "the better of x1 and xN between shared-memory buffers (in brackets: between private ones). memcpy: one "
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
                f"ratio to raw TCP, shared (≥{SPILL_TARGET}) (private)",
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
    exit_on_sigterm()
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
