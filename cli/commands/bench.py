"""`mooncake bench`: the quick transfer benchmark, against the running cluster.

The same workload as ``benchmarks/transfer.py``, shortened: this machine's single-thread memcpy per
size (the limit every figure is a ratio to), then per transport and size put and get_into
throughput, 4 KiB get latency, and a batched get_many_into of 64 KiB objects. Every loop is bounded
by --seconds and by an iteration count. Its keys live under ``bench/<uuid>/`` and are removed at
the end, also after an error, Ctrl-C, SIGTERM or SIGHUP.

This module is the typer command and its option checks; the measurements are in ``bench_measure``
and the progress display, tables and JSON in ``bench_report``.
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack, suppress
from enum import StrEnum
from typing import Annotated

import typer
from mooncake_cli.commands.bench_measure import (
    BATCH_OBJECT_BYTES,
    LEASE_MS,
    STOP,
    Bench,
    Results,
    cleanup,
    memcpy_gbps,
    room_bytes,
    shm_reachable,
    size_label,
    slots_for,
)
from mooncake_cli.commands.bench_report import as_json, progress_display, render
from mooncake_cli.context import (
    JsonOpt,
    NamespaceOpt,
    RedisUrlOpt,
    err,
    open_client,
    out,
    require_stdout,
    resolve_target,
    seconds_between,
)
from mooncake_cli.exits import CliError, ExitCode
from mooncake_cli.signals import signals_deferred, stopping_with

from mooncake_store import connect
from mooncake_store.config import format_size, parse_size

DEFAULT_SIZES = "4KiB,64KiB,1MiB,8MiB,32MiB"
MAX_SIZE = 1 << 30


class Transport(StrEnum):
    SHM = "shm"
    TCP = "tcp"
    BOTH = "both"


def parse_sizes(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise CliError(f"--sizes={text!r}: expected a comma-separated list such as {DEFAULT_SIZES}", ExitCode.USAGE)
    sizes = [parse_size(p, what="--sizes") for p in parts]
    for part, size in zip(parts, sizes, strict=True):
        if not 1 <= size <= MAX_SIZE:
            raise CliError(f"--sizes: {part!r} is {size} B; each size must be 1 B .. {format_size(MAX_SIZE)}",
                           ExitCode.USAGE)  # fmt: skip
    return sorted(set(sizes))


def bench(
    ctx: typer.Context,
    sizes: Annotated[
        str, typer.Option("--sizes", help="Comma-separated object sizes: 4KiB, 1MiB, 1048576 (bytes).")
    ] = DEFAULT_SIZES,
    transport: Annotated[
        Transport, typer.Option("--transport", help="Path to measure; both: shm (same host), then tcp.")
    ] = Transport.BOTH,
    seconds: Annotated[
        float,
        typer.Option(
            "--seconds", parser=seconds_between(0.01, 600), help="Time bound of each measured cell (0.01 to 600)."
        ),
    ] = 0.5,
    batch: Annotated[
        int, typer.Option("--batch", min=1, max=4096, help="Objects of 64 KiB per get_many_into batch.")
    ] = 128,
    json_out: JsonOpt = False,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Quick transfer benchmark against the running cluster, in GB/s and ratios to memcpy.

    First this machine's single-thread memcpy per size (the limit), then for each transport and size
    put and get_into throughput, 4 KiB get latency (p50, p99) and a batched get_many_into of 64 KiB
    objects. Each cell is bounded by --seconds and an iteration count. Keys are written under
    bench/<uuid>/ and all removed at the end, also after an error or Ctrl-C.
    """
    require_stdout()
    size_list = parse_sizes(sizes)
    transports = ["shm", "tcp"] if transport == Transport.BOTH else [str(transport)]
    target = resolve_target(ctx, redis_url, namespace)
    res = Results(prefix=f"bench/{uuid.uuid4().hex}/", seconds=seconds)
    with ExitStack() as stack:
        # Ctrl-C, a `kill` or a closed terminal unwind the run (they left its objects in the
        # cluster, taking its room) and end it with 128 + the signal's number; the first is
        # remembered for the loops, later ones are ignored.
        stack.enter_context(stopping_with(STOP))
        # open_client: a recorded cluster whose server died gets the advice that applies to it.
        base = stack.enter_context(open_client(target))
        agents, room, largest = room_bytes(base)
        if agents == 0:
            raise CliError("no live agents in the cluster: start some with `mooncake up` or `mooncake agent`")
        room = min(room, largest)  # one object must also fit on a single agent
        try:
            with progress_display() as progress:
                runner = Bench(base, target, res, progress)
                limits = sorted(set(size_list) | {BATCH_OBJECT_BYTES})
                task = progress.add_task("memcpy", total=len(limits))
                for size in limits:
                    progress.update(task, description=f"memcpy {size_label(size)}")
                    res.memcpy[size] = memcpy_gbps(size, seconds, slots_for(size, room))
                    progress.advance(task)
                progress.update(task, description="memcpy")
                for name in transports:
                    client = stack.enter_context(
                        connect(target.redis_url, namespace=target.namespace, transports=(name,), lease_ms=LEASE_MS)
                    )
                    if name == "shm" and not shm_reachable(client, f"{res.prefix}shm/probe"):
                        reason = "no agent's shared memory is reachable from this host"
                        if transport == Transport.SHM:
                            raise CliError(f"cannot benchmark shm: {reason}; use --transport tcp")
                        res.skipped.append({"transport": "shm", "what": "all", "reason": reason})
                        continue
                    runner.run_transport(client, name, size_list, batch, room)
        except BaseException:
            # A signal or a failure: still remove what was written, without hiding the first error.
            # Signals wait for the removal (a second one cut it short, leaving objects behind).
            with suppress(Exception), signals_deferred():
                cleanup(base, res.prefix)
            raise
        with signals_deferred():
            cleanup(base, res.prefix)
        STOP.check()  # a stop whose raise was lost ends the run with its status, not 0
    if json_out:
        out.print_json_document(as_json(res, target, agents))
    else:
        render(res, target, agents)
    err.print(f"[dim]removed the benchmark's keys under {res.prefix}[/dim]")
