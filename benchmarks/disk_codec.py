"""The disk-tier codec cases of benchmarks/tiers.py (issue 5, "Performance"): the tier's write and
read throughput and compression ratio against plain file writes and reads in the same run.

**Disk tier.** ``DiskTier`` directly (no agent): every chunk written (encode = optional byte-plane
shuffle + zstd level 3 + xxh3; then temp file, fsync, rename) and read back (read_bytes, zstd,
unshuffle, checksum), with shuffling off and on, against plain files of the same bytes (write,
fsync, rename; read_bytes) in the same run and the same directory. Data: (a) the KV cache of the
demo's tiny random-weight Llama (``mooncake_store.demo.DemoModel``) after a forward over a few
thousand random tokens, cut into the integration's 256-token chunks, as float16, bfloat16 and
float32; (b) random bytes (treated as a 2-byte dtype, so the shuffle runs on them too). Without
torch the KV data are synthetic (float16 normals with per-channel scales) and the table says so.
Reads come from the page cache for both the tier and the plain files (the files were just
written); the tier reads ``1/ratio`` as many bytes from a cold device.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    GB,
    MiB,
)

CHUNK_TOKENS = 256  # the integration's chunk: (layers, 2, kv_heads, 256, head_dim)


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
    from mooncake_store.tiers.chunk_format import shuffle_planes, unshuffle_planes

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
