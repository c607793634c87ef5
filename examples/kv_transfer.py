"""Scenario B in miniature: one process stores KV-cache-shaped arrays, another pulls them back.

    python examples/kv_transfer.py [--redis-url URL] [--total 256MiB] [--agents 2]

--total is moved in whole 8 MiB chunks (at least one).

With no URL it starts a private cluster (embedded Valkey + agent processes; with one, agents of its
own on that server, in a namespace of their own), stores a few hundred MiB of (layers, 2, tokens,
heads, head_dim) float16 chunks from this process, reads them back byte-exact from a second
process over shm and over tcp, prints where they live and how fast each step went, and stops
everything it started.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import signal
import sys
import time
from queue import Empty
from typing import Any

import numpy as np

from mooncake_store import LocalCluster, MooncakeError, connect
from mooncake_store.config import format_size, parse_size

#: How long a reader may take to answer: 256 MiB read twice takes about a second.
READER_TIMEOUT_S = 300.0

CHUNK_SHAPE = (8, 2, 256, 8, 128)  # layers, K/V, tokens, kv heads, head dim: 8 MiB of float16


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(CHUNK_SHAPE, dtype=np.float32).astype(np.float16)


def reader(url: str, namespace: str, count: int, transport: str, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    """Read the chunks back over ``transport``; puts (seconds, None) on ``queue``, -1.0 for bytes
    that differ, or (0.0, the error) when the store refused (an shm-only reader of agents on
    another host, a cluster gone meanwhile)."""
    try:
        with connect(url, namespace=namespace, transports=(transport,)) as client:
            outs = np.empty((count, *CHUNK_SHAPE), dtype=np.float16)
            outs.fill(0)  # touch the destination pages before timing, as an engine's buffers would be
            client.get_into("doc/chunk/0", outs[0])  # first contact: maps the agents' segments, opens sockets
            start = time.perf_counter()
            for i in range(count):
                client.get_into(f"doc/chunk/{i}", outs[i])
            seconds = time.perf_counter() - start
    except MooncakeError as exc:
        queue.put((0.0, f"{type(exc).__name__}: {exc}"))
        return
    exact = all(np.array_equal(outs[i], chunk(i)) for i in range(count))
    queue.put((seconds if exact else -1.0, None))


def read_back(ctx: Any, url: str, namespace: str, count: int, transport: str) -> float:
    """Time another process's read of the chunks over ``transport``. A reader that failed or died
    is a MooncakeError saying so: the wait for its answer was 300 s, then a queue.Empty traceback."""
    queue = ctx.Queue()
    proc = ctx.Process(target=reader, args=(url, namespace, count, transport, queue))
    proc.start()
    try:
        seconds, error = _answer(queue, proc, transport)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():  # stopped by its own PID, as everything this example starts
            proc.kill()
            proc.join()
    if error is not None:
        raise MooncakeError(f"the reader over {transport} failed: {error}")
    return seconds


def _answer(queue: Any, proc: Any, transport: str) -> tuple[float, str | None]:
    """The reader's answer, as soon as it comes or the reader is gone without one."""
    deadline = time.monotonic() + READER_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.5)
        except Empty:
            pass
        if not proc.is_alive():
            try:
                return queue.get(timeout=1.0)  # put just before it ended
            except Empty:
                raise MooncakeError(
                    f"the reader over {transport} ended with exit status {proc.exitcode} before answering"
                ) from None
    raise MooncakeError(f"the reader over {transport} did not answer within {READER_TIMEOUT_S:.0f} s")


def _size(text: str) -> int:
    """--total as argparse reads it: a size it cannot parse is a usage error, not a traceback."""
    try:
        return parse_size(text)
    except MooncakeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--redis-url",
        help="a Redis server to use as the index: this example's own agents run on it, in a namespace of their "
        "own, and are stopped at the end; a cluster's agents already there are not used "
        "(default: a private embedded server)",
    )
    parser.add_argument("--namespace", default=None)
    parser.add_argument("--total", default="256MiB", type=_size, help="bytes of KV chunks to move (default 256MiB)")
    parser.add_argument("--agents", type=int, default=2, help="agents to start, at least 1 (default 2)")
    args = parser.parse_args()
    if args.agents < 1:  # no node to store the chunks on: it failed with NoCapacity after starting
        parser.error(f"--agents {args.agents}: at least one agent holds the chunks")
    chunk_bytes = chunk(0).nbytes
    if args.total < chunk_bytes:  # moved one chunk all the same, and said nothing of it
        parser.error(f"--total {args.total} is less than one chunk ({format_size(chunk_bytes)}): it moves whole chunks")
    count = args.total // chunk_bytes
    # Stopped by Ctrl-C, a kill or a closed terminal, it unwinds: the cluster's context stops what
    # it started (Ctrl-C printed a KeyboardInterrupt traceback; SIGHUP ended it on the spot).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    arena = max(64 << 20, (count * chunk_bytes) // max(1, args.agents) + (64 << 20))
    try:
        with LocalCluster(args.agents, redis_url=args.redis_url, namespace=args.namespace, host_bytes=arena) as cluster:
            print(f"cluster: index {cluster.redis_url}, {args.agents} agents x {format_size(arena)} host arena")
            with connect(cluster.redis_url, namespace=cluster.namespace) as client:
                chunks = [chunk(i) for i in range(count)]
                start = time.perf_counter()
                client.put_many({f"doc/chunk/{i}": c for i, c in enumerate(chunks)})
                put_s = time.perf_counter() - start
                total = count * chunk_bytes
                print(
                    f"stored {count} chunks of {CHUNK_SHAPE} float16 = {format_size(total)} "
                    f"in {put_s * 1000:.0f} ms ({total / put_s / 1e9:.2f} GB/s)"
                )
                time.sleep(1.2)  # let the agents' heartbeats publish their use
                for node in client.stat().nodes:
                    tier = node.tiers[0]
                    print(
                        f"  {node.node_id}: {node.objects} chunks, {format_size(tier.used_bytes)} of "
                        f"{format_size(tier.capacity_bytes)} host memory, endpoint {node.tcp_endpoint}"
                    )
            ctx = mp.get_context("spawn")
            for transport in ("shm", "tcp"):
                seconds = read_back(ctx, cluster.redis_url, cluster.namespace, count, transport)
                if seconds < 0:
                    print(f"{transport}: MISMATCH in the bytes read back", file=sys.stderr)
                    return 1
                print(
                    f"another process read them back over {transport}: {seconds * 1000:.0f} ms "
                    f"({total / seconds / 1e9:.2f} GB/s), byte-exact"
                )
    except MooncakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.redis_url:
        print(f"stopped the {args.agents} agent(s) it started; the server at --redis-url runs on")
    else:
        print("stopped the cluster; nothing left running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
