"""`mooncake stat`: the node table and totals, once or continuously."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from mooncake_cli.context import (
    JsonOpt,
    NamespaceOpt,
    RedisUrlOpt,
    Target,
    live_out,
    open_client,
    out,
    require_stdout,
    resolve_target,
    seconds_between,
)
from mooncake_cli.render import cluster_view, stats_json
from mooncake_cli.signals import StopOnce, stopping_with
from rich.live import Live
from rich.text import Text

from mooncake_store import Client


def stat(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C (with --json: one JSON line per refresh).")
    ] = False,
    interval: Annotated[
        float | None,
        typer.Option(
            "--interval",
            parser=seconds_between(0.1, 3600),
            help="Seconds between refreshes with --watch (0.1 to 3600; default 1).",
        ),
    ] = None,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Show the cluster: nodes, zones, endpoints, transports, tier use, objects, heartbeats, totals."""
    if interval is not None and not watch:  # it was taken and ignored: `stat --interval 5` printed once
        raise typer.BadParameter("applies to --watch only: add --watch (-w)", param_hint="'--interval'")
    interval = 1.0 if interval is None else interval
    require_stdout()
    target = resolve_target(ctx, redis_url, namespace)
    with open_client(target) as client:
        header = Text.assemble(("index ", "dim"), target.shown_url, ("  namespace ", "dim"), target.namespace)
        if not watch:
            stats = client.stat()
            if as_json:
                out.print_json_document(stats_json(stats, redis_url=target.shown_url, namespace=target.namespace))
            else:
                out.print(cluster_view(stats, header=header))
            return
        # Ctrl-C, a `kill` or a closed terminal end the watch as one: the live view puts the
        # terminal's cursor back (by SIGTERM's default action it stayed hidden), and the status
        # is 128 + the signal's number.
        with stopping_with(StopOnce()) as stop:
            _watch(client, target, header, interval, stop, as_json=as_json)


def _watch(client: Client, target: Target, header: Text, interval: float, stop: StopOnce, *, as_json: bool) -> None:
    if as_json:
        while True:  # JSON lines: a consumer can parse each refresh as it arrives
            data = stats_json(client.stat(), redis_url=target.shown_url, namespace=target.namespace)
            print(json.dumps(data), flush=True)
            stop.check()
            time.sleep(interval)
    if not out.is_terminal:
        # Into a file or a pipe a live display shows nothing until it stops: one block per
        # refresh instead, each out as soon as it is drawn (`mooncake stat -w | head` ends).
        while True:
            out.print(cluster_view(client.stat(), header=header))
            out.print()
            out.file.flush()
            stop.check()
            time.sleep(interval)
    with Live(console=live_out, auto_refresh=False) as live:
        while True:
            live.update(cluster_view(client.stat(), header=header), refresh=True)
            stop.check()
            time.sleep(interval)
