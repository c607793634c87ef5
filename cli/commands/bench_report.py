"""The output of `mooncake bench`: the progress display while it runs, then the tables or the JSON."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mooncake_cli.commands.bench_measure import Results
from mooncake_cli.context import Target, err, out, wide_out
from mooncake_cli.render import figures_view
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text


@contextmanager
def progress_display() -> Iterator[Progress]:
    """A live display on stderr that clears itself, and stays off when stderr is not a terminal, so
    that neither the tables nor --json on stdout are mixed with progress lines."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as progress:
        yield progress


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:.{digits}f}"  # NaN: no limit measured


def _ratio_text(r: float) -> Text:
    return Text(_fmt(r), "green" if r >= 0.8 else "yellow" if r >= 0.4 else "red")


def render(res: Results, target: Target, agents: int) -> None:
    out.print(
        Text.assemble(("index ", "dim"), target.shown_url, ("  namespace ", "dim"), target.namespace,
                      ("  agents ", "dim"), str(agents), ("  seconds/cell ", "dim"), f"{res.seconds:g}")
    )  # fmt: skip
    table = Table(header_style="bold", box=None, padding=(0, 1), pad_edge=False,
                  title="GB/s, and ratio to this machine's single-thread memcpy", title_justify="left")  # fmt: skip
    for name in ("path", "size", "memcpy", "put", "put/memcpy", "get_into", "get/memcpy", "keys"):
        table.add_column(name, justify="left" if name in ("path", "size") else "right", no_wrap=True)
    rows: list[list[str | Text]] = [
        [c["transport"], c["size"], _fmt(c["memcpy_gbps"]), _fmt(c["put_gbps"]), _ratio_text(c["put_ratio"]),
         _fmt(c["get_gbps"]), _ratio_text(c["get_ratio"]), str(c["keys"])]
        for c in res.cells
    ]  # fmt: skip
    for row in rows:
        table.add_row(*row)
    console = out if out.is_terminal else wide_out  # into a pipe or a file, whole lines
    console.print(figures_view(table, rows, names=2))
    batches = {b["transport"]: b for b in res.batch}
    objects = res.batch[0]["objects"] if res.batch else 0
    title = f"4 KiB get_into latency (µs); put_many / get_many_into of {objects} x 64 KiB (GB/s)"
    extra = Table(header_style="bold", box=None, padding=(0, 1), pad_edge=False, title=title, title_justify="left")
    for name in ("path", "p50 µs", "p99 µs", "put_many", "get_many", "get/memcpy", "batch p50 ms"):
        extra.add_column(name, justify="left" if name == "path" else "right", no_wrap=True)
    extra_rows: list[list[str | Text]] = []
    for lat in res.latency:
        b = batches.get(lat["transport"])
        extra_rows.append([
            lat["transport"], _fmt(lat["get_p50_us"], 0), _fmt(lat["get_p99_us"], 0),
            _fmt(b["put_many_gbps"]) if b else "-", _fmt(b["get_many_gbps"]) if b else "-",
            _ratio_text(b["get_many_ratio"]) if b else "-", _fmt(b["get_many_p50_ms"], 2) if b else "-",
        ])  # fmt: skip
        extra.add_row(*extra_rows[-1])
    console.print()
    console.print(figures_view(extra, extra_rows))
    for s in res.skipped:
        err.print(f"[yellow]skipped[/yellow] {s['transport']} {escape(s['what'])}: {escape(s['reason'])}")


def as_json(res: Results, target: Target, agents: int) -> dict[str, Any]:
    def clean(v: Any) -> Any:
        if isinstance(v, float):
            return None if v != v else round(v, 4)
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return clean({
        "redis_url": target.shown_url, "namespace": target.namespace, "agents": agents, "prefix": res.prefix,
        "seconds": res.seconds, "memcpy_gbps": {str(k): v for k, v in res.memcpy.items()},
        "cells": res.cells, "latency": res.latency, "batch": res.batch, "skipped": res.skipped,
    })  # fmt: skip
