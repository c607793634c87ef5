"""Scenario A, long-document Q&A, in one command: ``python -m mooncake_store.demo``.

Starts an embedded cluster (a private Valkey and two agents), builds a small Llama-style causal LM
from a config with random weights (no download), makes a document of several thousand tokens and
asks three questions about it. The first question computes the document's KV cache and stores it
in chunks; the second restores it in this process; the third restores it in another process.
Each answer is checked against a full recompute. Needs the ``hf`` extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mooncake_store.errors import signal_exit_status
from mooncake_store.watchdog import STOP_SIGNALS

HF_MISSING = (
    "The demo runs a small transformers model and needs the 'hf' extra (torch + transformers).\n"
    "Install it with:\n"
    "    pip install 'mooncake-store[hf]'\n"
    "(a CPU build of torch is enough: install one first if you do not want a CUDA build pulled in).\n"
)


#: The longest document the demo takes: its cache (8 KiB a token on the default model) fills
#: 8 GiB per copy, and its prefill on a CPU takes hours. Past a bound, a typo's length (1e11)
#: failed in torch's allocator, after the model was built, without naming the option.
MAX_DOC_TOKENS = 1 << 20
#: Tokens generated per answer at most: the demo shows the time to the first one; 100000 ran on
#: with no end in sight.
MAX_NEW_TOKENS = 1024
#: torch CPU threads at most, per CPU: 100000 failed in libgomp ("Resource temporarily
#: unavailable") and then crashed the process (SIGSEGV) with its cluster up.
THREADS_PER_CPU = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoModel:
    """The demo's model: a Llama-style decoder, random weights from ``seed``."""

    vocab_size: int = 8000
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 32768
    initializer_range: float = 0.2
    seed: int = 0

    def parameter_count(self) -> int:
        """What build() makes (LlamaForCausalLM: no biases, untied head), known before it is built."""
        h, kv = self.hidden_size, self.num_key_value_heads * (self.hidden_size // self.num_attention_heads)
        layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return 2 * self.vocab_size * h + self.num_hidden_layers * layer + h

    def kv_bytes_per_token(self) -> int:
        """A token's float32 K and V over every layer, by the layout the store keys caches by."""
        from mooncake_store.integrations.transformers import kv_layout

        layers, kv_heads, head_dim = kv_layout(self.llama_config())
        return layers * 2 * kv_heads * head_dim * 4

    def llama_config(self) -> Any:
        import transformers

        return transformers.LlamaConfig(**{k: v for k, v in asdict(self).items() if k != "seed"})

    def build(self) -> Any:
        import torch
        import transformers

        torch.manual_seed(self.seed)
        return transformers.LlamaForCausalLM(self.llama_config()).eval()


def document_and_questions(vocab: int, doc_tokens: int, seed: int = 1) -> tuple[Any, list[Any]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    doc = torch.randint(0, vocab, (doc_tokens,), generator=g)
    questions = [torch.randint(0, vocab, (20 + 4 * i,), generator=g) for i in range(3)]
    return doc, questions


def answer(model: Any, cache: Any, prompt: Any, new_tokens: int, *, use_store: bool) -> dict[str, Any]:
    """Answer one prompt: restore what the store has (if ``use_store``), prefill the rest, store
    the new full chunks, generate ``new_tokens`` greedily. Returns timings and tokens."""
    import torch

    from mooncake_store.integrations.transformers import cache_kwargs, load_prefix, output_cache, save_prefix

    with torch.no_grad():
        t0 = time.perf_counter()
        matched, past = load_prefix(cache, prompt, model) if use_store else (0, None)
        t1 = time.perf_counter()
        kw = cache_kwargs(model, past) if past is not None else {}
        out = model(prompt[matched:][None], use_cache=True, **kw)
        t2 = time.perf_counter()
        kv = output_cache(out)
        written = save_prefix(cache, prompt, kv) if use_store else 0
        t3 = time.perf_counter()
        tokens = []
        nxt = out.logits[0, -1].argmax()
        for _ in range(new_tokens):
            tokens.append(int(nxt))
            out = model(nxt.view(1, 1), use_cache=True, **cache_kwargs(model, kv))
            kv = output_cache(out)
            nxt = out.logits[0, -1].argmax()
    return {
        "prompt_tokens": len(prompt),
        "matched_tokens": matched,
        "restore_s": t1 - t0,
        "prefill_s": t2 - t1,
        "store_s": t3 - t2,
        "chunks_written": written,
        "ttft_s": t2 - t0,
        "answer": tokens,
    }


def _worker(args: argparse.Namespace) -> int:
    """The third question, asked from another process (same seed, same weights)."""
    from mooncake_store import PrefixCache, connect
    from mooncake_store.integrations.transformers import kv_namespace

    spec = DemoModel(**json.loads(args.model))
    model = spec.build()
    doc, questions = document_and_questions(spec.vocab_size, args.doc_tokens)
    import torch

    with connect(args.redis_url, namespace=args.namespace) as client:
        cache = PrefixCache(client, kv_namespace(model, model_id="demo-llama"), chunk_tokens=args.chunk_tokens)
        result = answer(model, cache, torch.cat([doc, questions[2]]), args.new_tokens, use_store=True)
        cache.close()
    result["pid"] = os.getpid()
    print(json.dumps(result), flush=True)
    return 0


def _memory_refused(host_bytes: int, doc_bytes: int, *, model_bytes: int) -> str | None:
    """Why the demo would not fit in this machine's memory, or None. Its two arenas are prefaulted
    at start, and beside them it holds the document's cache twice (restored, and recomputed for
    the check) and the third question's process a model and a cache of its own: --layers 1000 had
    two 11.5 GiB arenas start on 24 GiB, and the kernel's OOM killer ended the demo, its agents
    left running with their arenas."""
    from mooncake_store.tiers.host import arenas_refused, memory_available_bytes

    why = arenas_refused(2, host_bytes)
    if why is not None:
        return why
    need = 2 * host_bytes + 3 * doc_bytes + model_bytes
    available = memory_available_bytes()
    if available is not None and need > available:
        return (
            f"it needs about {need} B of memory (two {host_bytes} B arenas, the document's {doc_bytes} B cache "
            f"three times, a second {model_bytes} B model), and the machine has {available} B available"
        )
    return None


def _int_from(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int of at least ``low`` (and at most ``high``), checked before torch
    loads and the cluster starts (exit status 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value} is more than {high}")
        return value

    return parse


#: The stop signal the demo is unwinding for, once one came.
_UNWINDING: list[int] = []


def _unwind_once(signum: int, _frame: object) -> None:
    """Unwind, then exit 128 + ``signum``; the stop signals that come after do nothing: raised
    again inside the unwinding (an impatient user, a supervisor), they cut the cluster's stop short.
    The handler stays (set to SIG_IGN here, a signal already pending was reported as "ignored due
    to race condition", with a traceback) until the process exits (then SIG_IGN: at its shutdown
    the interpreter puts the default action back, which ended it by the signal instead)."""
    if _UNWINDING:
        return
    _UNWINDING.append(signum)
    atexit.register(lambda: [signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS])
    sys.exit(signal_exit_status(signum))


def _exit_if_unwinding() -> None:
    """Raise the stop's exit again where the demo checks for it between its steps. The handler
    raises in whatever code the signal lands in, and where that is a finalizer (a redis
    connection pool's __del__, run by the garbage collector) Python prints "Exception ignored"
    and goes on: the later signals were ignored, the demo ran to its end and exited 0 after a
    SIGTERM (seen in CI). As the CLI's `StopOnce.check`."""
    if _UNWINDING:
        sys.exit(signal_exit_status(_UNWINDING[0]))


def _quiet_about_a_lost_stop(previous_hook: Callable[[Any], object]) -> Callable[[Any], None]:
    """A ``sys.unraisablehook``: the stop's SystemExit, raised in a finalizer and lost there, is not
    printed as "Exception ignored ... SystemExit: 143" with a traceback that looks like a crash
    (`_exit_if_unwinding` carries the stop out); anything else goes to ``previous_hook``."""

    def hook(unraisable: Any) -> None:
        if not (_UNWINDING and isinstance(unraisable.exc_value, SystemExit)):
            previous_hook(unraisable)

    return hook


def main(argv: list[str] | None = None, *, prog: str = "python -m mooncake_store.demo") -> int:
    """``prog``: the command line the usage and errors name (`mooncake demo` from the CLI)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    positive = _int_from(1)
    p.add_argument(
        "--doc-tokens",
        type=_int_from(1, MAX_DOC_TOKENS),
        default=6000,
        help=f"document length in tokens (default 6000, at most {MAX_DOC_TOKENS})",
    )
    # PrefixCache's bound: refused only once the model was built and the cluster up (~13 s) before.
    from mooncake_store.client.prefix import MAX_CHUNK_TOKENS

    chunk_tokens = _int_from(1, MAX_CHUNK_TOKENS)
    p.add_argument("--chunk-tokens", type=chunk_tokens, default=256, help="tokens per stored chunk (default 256)")
    p.add_argument(
        "--new-tokens",
        type=_int_from(1, MAX_NEW_TOKENS),
        default=8,
        help=f"tokens generated per answer (default 8, at most {MAX_NEW_TOKENS})",
    )
    p.add_argument("--layers", type=positive, default=8, help="decoder layers of the demo model (default 8)")
    max_threads = THREADS_PER_CPU * (os.cpu_count() or 1)
    p.add_argument(
        "--threads",
        type=_int_from(0, max_threads),
        default=0,
        help=f"torch CPU threads (default 0: torch's choice; at most {max_threads}, {THREADS_PER_CPU} per CPU)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the full recompute that checks each answer")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--redis-url", help=argparse.SUPPRESS)
    p.add_argument("--namespace", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.doc_tokens < args.chunk_tokens:  # no chunk to store: the demo ran and showed nothing
        p.error(
            f"--doc-tokens {args.doc_tokens} is less than --chunk-tokens {args.chunk_tokens}: the document "
            "must fill at least one chunk for its questions to share"
        )

    try:
        import torch
        import transformers
    except ImportError as exc:
        sys.stderr.write(f"mooncake demo: {exc}.\n{HF_MISSING}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        return _worker(args)
    # SIGTERM and SIGHUP unwind as Ctrl-C does, so the cluster below stops what it started (by
    # default they end the process on the spot, leaving the server, the agents and their shared
    # memory), then exit with the status a shell gives a process that signal ended, as the CLI's
    # commands do. Ctrl-C too, so that the first of several pending at once (run in signal-number
    # order, SIGINT first) leaves the others ignored rather than raised inside the unwinding.
    for sig in STOP_SIGNALS:
        signal.signal(sig, _unwind_once)
    sys.unraisablehook = _quiet_about_a_lost_stop(sys.unraisablehook)

    from mooncake_store import LocalCluster, PrefixCache, connect
    from mooncake_store.config import format_size
    from mooncake_store.integrations.transformers import kv_namespace

    # Room for the prompt (the document and a question) and the tokens generated after it.
    positions = max(32768, args.doc_tokens + 64 + args.new_tokens)
    spec = DemoModel(num_hidden_layers=args.layers, max_position_embeddings=positions)
    params, kv_per_token = spec.parameter_count(), spec.kv_bytes_per_token()
    doc_bytes = args.doc_tokens * kv_per_token
    host_bytes = max(256 << 20, 2 * doc_bytes + (64 << 20))
    # Judged before the model is built: 100000 layers would take 300 GB to build.
    too_much = _memory_refused(host_bytes, doc_bytes, model_bytes=params * 4)
    if too_much is not None:
        sys.stderr.write(f"mooncake demo: {too_much}; use fewer --doc-tokens or --layers\n")
        return 5  # no room, as `mooncake up` says it
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"mooncake-store demo: long-document Q&A ({versions})")
    t = time.perf_counter()
    model = spec.build()
    print(
        f"model     Llama-style, {params / 1e6:.1f}M parameters, random weights (seed {spec.seed}), float32 on CPU; "
        f"KV cache {kv_per_token // 1024} KiB/token  [{time.perf_counter() - t:.1f} s]"
    )
    doc, questions = document_and_questions(spec.vocab_size, args.doc_tokens)
    t = time.perf_counter()
    with (
        LocalCluster(num_agents=2, host_bytes=host_bytes) as cluster,
        connect(cluster.redis_url, namespace=cluster.namespace) as client,
    ):
        print(
            f"cluster   embedded Valkey at {cluster.redis_url} + 2 agents x {host_bytes >> 20} MiB host arena  "
            f"[{time.perf_counter() - t:.1f} s]"
        )
        cache = PrefixCache(client, kv_namespace(model, model_id="demo-llama"), chunk_tokens=args.chunk_tokens)
        print(
            f"document  {args.doc_tokens} tokens = {args.doc_tokens // args.chunk_tokens} chunks of "
            f"{args.chunk_tokens} tokens, {doc_bytes / 2**20:.0f} MiB of KV; namespace {cache.namespace!r}"
        )
        print()
        header = f"{'':4}{'where':<16}{'prompt':>7}{'matched':>9}{'restore':>10}{'prefill':>10}{'TTFT':>9}  answer"
        print(header)
        rows = []
        for i, where in enumerate(("this process", "this process", "another process")):
            _exit_if_unwinding()
            prompt = torch.cat([doc, questions[i]])
            if where == "another process":
                out = subprocess.run(
                    [sys.executable, "-m", "mooncake_store.demo", "--worker", "--redis-url", cluster.redis_url,
                     "--namespace", cluster.namespace, "--model", json.dumps(asdict(spec)),
                     "--doc-tokens", str(args.doc_tokens), "--chunk-tokens", str(args.chunk_tokens),
                     "--new-tokens", str(args.new_tokens)] + (["--threads", str(args.threads)] if args.threads else []),
                    capture_output=True, text=True, timeout=600,
                )  # fmt: skip
                if out.returncode != 0:
                    sys.stderr.write(out.stderr[-3000:])
                    return 1
                r = json.loads(out.stdout.strip().splitlines()[-1])
                where = f"pid {r['pid']}"
            else:
                r = answer(model, cache, prompt, args.new_tokens, use_store=True)
            if not args.no_check and r["matched_tokens"] == 0:
                r["recompute_s"], r["same_as_recompute"] = r["prefill_s"], True  # it was the recompute
            elif not args.no_check:
                full = answer(model, cache, prompt, args.new_tokens, use_store=False)
                r["recompute_s"] = full["prefill_s"]
                r["same_as_recompute"] = full["answer"] == r["answer"]
            _exit_if_unwinding()
            rows.append(r)
            restore = f"{r['restore_s'] * 1000:.0f} ms" if r["matched_tokens"] else "-"
            print(
                f"Q{i + 1}  {where:<16}{r['prompt_tokens']:>7}{r['matched_tokens']:>9}{restore:>10}"
                f"{r['prefill_s'] * 1000:>8.0f} ms{r['ttft_s']:>7.2f} s  {r['answer']}"
                + ("" if args.no_check else ("  = recompute" if r["same_as_recompute"] else "  != RECOMPUTE"))
            )
        print()
        first, later = rows[0], rows[1:]
        for i, r in enumerate(later, start=2):
            if r["matched_tokens"]:
                print(
                    f"Q{i}: restored {r['matched_tokens']} tokens in {r['restore_s'] * 1000:.0f} ms instead of "
                    f"prefilling them ({first['prefill_s'] * 1000:.0f} ms for Q1's {first['prompt_tokens']} tokens): "
                    f"time to first token {_ttft_change(first['ttft_s'], r['ttft_s'])}"
                )
        stats = client.stat()
        written_later = sum(r["chunks_written"] for r in later)
        shared = first["chunks_written"] and not written_later  # what the demo shows, when it holds
        print(
            f"store: {stats.objects} objects, {format_size(stats.used_bytes)} used on {len(stats.live_nodes)} "
            f"agents; chunks written by Q1: {first['chunks_written']}, by Q2/Q3: {written_later}"
            + (" (the document's chunks are shared)" if shared else "")
        )
        cache.close()
        _exit_if_unwinding()
        ok = args.no_check or all(r["same_as_recompute"] for r in rows)
        if not ok:
            print("an answer differs from the full recompute", file=sys.stderr)
    _exit_if_unwinding()  # a stop that landed in the cluster's stop, in a finalizer
    return 0 if ok else 1


def _ttft_change(before_s: float, after_s: float) -> str:
    """ "4.0x shorter", or, where a restore took longer than the recompute (a tiny document on a
    busy machine), "1.5x longer": it said "0.2x shorter"."""
    if after_s <= before_s:
        return f"{before_s / max(after_s, 1e-9):.1f}x shorter"
    return f"{after_s / max(before_s, 1e-9):.1f}x longer"


if __name__ == "__main__":
    sys.exit(main())
