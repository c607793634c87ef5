"""Prefix cache benchmarks: match latency by chain length, the per-chunk object layout, and
restoring a prompt's KV cache against prefilling it.

    .venv/bin/python benchmarks/prefix.py            # all three parts
    .venv/bin/python benchmarks/prefix.py --quick    # fewer repetitions, no 16K prefill

1. ``match`` latency (p50/p99) for chains of 64, 512 and 4,096 stored chunks: the whole
   ``PrefixCache.match`` (hashing the tokens + one Lua call) and the Lua call alone, each next to
   this machine's own floor, a Redis PING round trip on the same connection.
2. Layout: the KV cache of 4K tokens of the demo model stored as one object per chunk (all layers'
   K and V) and as one object per (chunk, layer); store and restore time, next to a memcpy of the
   same bytes.
3. Restore vs prefill for the demo model (``mooncake_store.demo.DemoModel``) at 1K, 4K, 16K tokens:
   ``load_prefix`` time against the forward pass over the same tokens, both the median of a few
   samples after one warm-up call. Needs the hf extra.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import exit_on_stop_signals, machine_line

from mooncake_store import LocalCluster, PrefixCache, connect

MiB = 1 << 20
#: Prefill samples per size (after one warm-up forward), and the seconds after which no more are
#: taken once PREFILL_MIN_SAMPLES are in (a 16K-token forward on CPU takes seconds).
PREFILL_SAMPLES = 5
PREFILL_MIN_SAMPLES = 3
PREFILL_SECONDS = 20.0


def timings(
    fn: Callable[[], object], *, count: int, seconds: float, warmup: int = 3, min_count: int = 5
) -> list[float]:
    """Per-call seconds of ``fn``: at most ``count`` calls, and none after ``seconds`` once
    ``min_count`` are in."""
    for _ in range(warmup):
        fn()
    out: list[float] = []
    start = time.perf_counter()
    while len(out) < count and (time.perf_counter() - start < seconds or len(out) < min_count):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e6


def bench_match(cluster: LocalCluster, *, quick: bool) -> None:
    print("\n== match latency (one Lua call walking the chain; chunks on live agents) ==")
    client = connect(cluster.redis_url, namespace=cluster.namespace)
    cache = PrefixCache(client, "bench/match", chunk_tokens=256)
    ping = timings(client.index.redis.ping, count=5000, seconds=1.0 if quick else 3.0)
    print(f"floor: Redis PING round trip p50 {pct(ping, 50):.0f} us, p99 {pct(ping, 99):.0f} us")
    print(f"{'chunks':>7} {'match p50':>10} {'p99':>8} {'Lua call p50':>13} {'p99':>8} {'hashing':>8}  x PING (p50)")
    tiny = np.zeros(16, np.uint8)
    for n in (64, 512, 4096):
        tokens = np.arange(n * 256, dtype=np.int64) + 7 * n
        cache.store(tokens, lambda i: tiny)
        keys = cache.keys(tokens)
        assert cache.match(tokens) == n * 256
        whole = timings(lambda: cache.match(tokens), count=2000, seconds=1.0 if quick else 3.0)  # noqa: B023
        lua = timings(lambda: cache.index.match(keys), count=2000, seconds=1.0 if quick else 3.0)  # noqa: B023
        hashing = timings(lambda: cache.keys(tokens), count=200, seconds=0.5)  # noqa: B023
        print(
            f"{n:>7} {pct(whole, 50):>8.0f}us {pct(whole, 99):>6.0f}us {pct(lua, 50):>11.0f}us "
            f"{pct(lua, 99):>6.0f}us {pct(hashing, 50):>6.0f}us  {statistics.median(lua) / statistics.median(ping):.1f}"
        )
    cache.close()
    client.close()


def bench_layout(cluster: LocalCluster, *, quick: bool) -> None:
    from mooncake_store.demo import DemoModel

    spec = DemoModel()
    layers, kv_heads = spec.num_hidden_layers, spec.num_key_value_heads
    head_dim = spec.hidden_size // spec.num_attention_heads
    tokens, chunk = 4096, 256
    n = tokens // chunk
    print(f"\n== layout: {tokens} tokens of the demo model's KV ({layers} layers, {kv_heads} KV heads, "
          f"head dim {head_dim}, float32), chunks of {chunk} tokens ==")  # fmt: skip
    client = connect(cluster.redis_url, namespace=cluster.namespace)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((n, layers, 2, kv_heads, chunk, head_dim), dtype=np.float32)
    total = data.nbytes
    dest = np.empty_like(data)
    memcpy = timings(lambda: np.copyto(dest, data), count=20, seconds=1.0)
    print(f"floor: memcpy of {total / MiB:.0f} MiB p50 {statistics.median(memcpy) * 1e3:.1f} ms "
          f"({total / statistics.median(memcpy) / 1e9:.1f} GB/s)")  # fmt: skip
    variants = {
        "one object per chunk": (
            {f"lay/c/{i}": data[i] for i in range(n)},
            [dest[i] for i in range(n)],
        ),
        "one object per (chunk, layer)": (
            {f"lay/l/{i}/{j}": data[i, j] for i in range(n) for j in range(layers)},
            [dest[i, j] for i in range(n) for j in range(layers)],
        ),
    }
    print(f"{'layout':<32}{'objects':>8}{'store p50':>11}{'restore p50':>13}{'x memcpy':>10}")
    for name, (items, outs) in variants.items():
        keys = list(items)
        store = timings(lambda: client.put_many(items), count=10 if quick else 30, seconds=2.0, warmup=1)  # noqa: B023
        # dest already holds data (the memcpy floor, the variant before): NaN it, so that the check
        # below sees only what this variant's restores wrote.
        dest.fill(np.nan)
        restore = timings(lambda: client.get_many_into(keys, outs), count=20 if quick else 60, seconds=2.0)  # noqa: B023
        np.testing.assert_array_equal(dest, data, err_msg=f"{name}: restore returned wrong bytes")
        print(
            f"{name:<32}{len(items):>8}{statistics.median(store) * 1e3:>9.1f}ms"
            f"{statistics.median(restore) * 1e3:>11.1f}ms"
            f"{statistics.median(restore) / statistics.median(memcpy):>10.1f}"
        )
        client.remove_many(keys)
    client.close()


def bench_restore(cluster: LocalCluster, *, quick: bool) -> None:
    try:
        import torch
    except ImportError:
        print("\n== restore vs prefill: skipped, torch/transformers not installed (pip install 'mooncake-store[hf]')")
        return
    from mooncake_store.demo import DemoModel, document_and_questions
    from mooncake_store.integrations.transformers import (
        _layers,
        kv_namespace,
        load_prefix,
        output_cache,
        save_prefix,
    )

    spec = DemoModel(max_position_embeddings=32768)
    model = spec.build()
    print(f"\n== restore vs prefill: demo model ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{spec.num_hidden_layers} layers, float32, CPU, {torch.get_num_threads()} threads) ==")  # fmt: skip
    client = connect(cluster.redis_url, namespace=cluster.namespace)
    cache = PrefixCache(client, kv_namespace(model, model_id="bench"), chunk_tokens=256)
    print(f"{'tokens':>7}{'prefill p50':>12}{'store':>9}{'restore p50':>13}{'restore/prefill':>17}")
    for n in (1024, 4096) if quick else (1024, 4096, 16384):
        doc, _ = document_and_questions(spec.vocab_size, n, seed=n)
        last: dict[str, object] = {}

        def forward(d: torch.Tensor = doc, keep: dict[str, object] = last) -> None:
            keep.pop("out", None)  # the last sample's cache is not held through the next forward
            with torch.no_grad():
                keep["out"] = model(d[None], use_cache=True)

        # As restore below: one warm-up call (first-touch allocations, thread pools), then the median
        # of a few samples, bounded in count and time.
        prefills = timings(
            forward, count=PREFILL_SAMPLES, seconds=PREFILL_SECONDS, warmup=1, min_count=PREFILL_MIN_SAMPLES
        )
        prefill = statistics.median(prefills)
        out = last.pop("out")
        t = time.perf_counter()
        save_prefix(cache, doc, output_cache(out))
        store = time.perf_counter() - t
        stored = [(k.clone(), v.clone()) for k, v in _layers(output_cache(out))]  # for the check below
        del out
        prompt = torch.cat([doc, doc[:1]])
        restore = timings(lambda: load_prefix(cache, prompt, model), count=5 if quick else 15, seconds=5.0, warmup=1)  # noqa: B023
        r = statistics.median(restore)
        # What was timed restored the whole prefix, as it was stored: a restore that found
        # nothing takes ~1 ms and would pass for a fast one.
        restored, kv = load_prefix(cache, prompt, model)
        # Every layer's keys and values: a check of layer 0's keys passed a restore of wrong values.
        pairs = zip(_layers(kv), stored, strict=True)
        same = all(torch.equal(k, sk) and torch.equal(v, sv) for (k, v), (sk, sv) in pairs)
        if restored != n or not same:
            raise RuntimeError(f"restore of {n} tokens restored {restored}, or other keys or values than were stored")
        print(f"{n:>7}{prefill:>11.2f}s{store * 1e3:>7.0f}ms{r * 1e3:>11.1f}ms{r / prefill:>16.1%}")
    cache.close()
    client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=("match", "layout", "restore"))
    args = p.parse_args(argv)
    exit_on_stop_signals()
    print(machine_line())
    with LocalCluster(num_agents=2, host_bytes=1024 * MiB) as cluster:
        for name, fn in (("match", bench_match), ("layout", bench_layout), ("restore", bench_restore)):
            if args.only in (None, name):
                fn(cluster, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
