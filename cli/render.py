"""Tables for people: the cluster view shared by `stat`, `stat --watch` and the `up` live view."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from mooncake_store import ClusterStats
from mooncake_store.config import format_size


def age(seconds: float) -> str:
    if seconds < 0:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def use_percent(used: int, capacity: int) -> Text:
    frac = used / capacity if capacity else 0.0
    # Yellow and red where the agent would soon start turning puts away.
    return Text(f"{frac:.0%}", "green" if frac < 0.7 else "yellow" if frac < 0.9 else "red")


#: How narrow (characters) a name column may fold where the table is too wide for the output.
FOLD_MIN_WIDTH = {"node": 10, "zone": 8, "endpoint": 15, "via": 7}


def _name_column(table: Table, name: str, values: list[str], *, fold: bool) -> None:
    """A column of names: kept on their lines, or with ``fold`` folded onto further lines where
    the width runs short (never narrower than FOLD_MIN_WIDTH, or than its longest name)."""
    if fold:
        longest = max(map(len, values), default=len(name))
        table.add_column(name, overflow="fold", min_width=min(longest, FOLD_MIN_WIDTH[name]))
    else:
        table.add_column(name, no_wrap=True)


class _Fitted:
    """A table laid out for the width it is printed in: as built, where it fits; else with its
    name columns folding. With every column unwrappable, rich cut each one short where the table
    was too wide ("us-east…" for us-east-1a and us-east-1b alike, "8.0 M…", the spill columns
    gone for a long node id), into a pipe's 80 columns too; with name columns that fold always,
    rich laid a table that fits out a column wider than 80."""

    def __init__(self, build: Callable[[bool], Table]) -> None:
        self._build = build

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = self._build(False)
        # Its narrowest layout (two-word headers folded), measured as if the width were unbounded:
        # rich clamps a table's measure to the width given.
        if Measurement.get(console, options.update_width(1 << 16), table).minimum > options.max_width:
            table = self._build(True)
        yield table


def nodes_table(stats: ClusterStats, *, fold: bool = False) -> Table:
    """One row per node and tier; compact on purpose, so that it fits an 80-column terminal."""
    table = Table(header_style="bold", box=None, padding=(0, 1), pad_edge=False, collapse_padding=True)
    _name_column(table, "node", [n.node_id for n in stats.nodes], fold=fold)
    _name_column(table, "zone", [n.zone for n in stats.nodes], fold=fold)
    _name_column(table, "endpoint", [n.tcp_endpoint for n in stats.nodes], fold=fold)
    _name_column(table, "via", [",".join(n.transports) for n in stats.nodes], fold=fold)
    table.add_column("tier", no_wrap=True)
    for name in ("used", "capacity", "use", "objs", "hb age"):
        table.add_column(name, justify="right", no_wrap=True)
    for node in stats.nodes:
        # The heartbeat age, green while the node is inside its deadline, red once past it.
        hb = Text(age(node.heartbeat_age_s) + ("" if node.alive else " dead"), "green" if node.alive else "red")
        for i, tier in enumerate(node.tiers or [None]):
            first = i == 0
            row: list[Any] = [
                Text(node.node_id, "bold") if first else "",
                Text(node.zone) if first else "",
                Text(node.tcp_endpoint) if first else "",  # "[fd00::7]:7000" is no style tag
                ",".join(node.transports) if first else "",
                tier.tier if tier else "-",
                format_size(tier.used_bytes) if tier else "-",
                format_size(tier.capacity_bytes) if tier else "-",
                use_percent(tier.used_bytes, tier.capacity_bytes) if tier else "",
                str(tier.objects) if tier else str(node.objects),  # what the tier holds
                hb if first else "",
            ]
            table.add_row(*row)
    return table


#: Per-tier counters of the activity table: (column, TierStats field).
ACTIVITY = (
    ("hits", "hits"),
    ("reads", "reads"),
    ("demoted", "demotions"),
    ("promoted", "promotions"),
    ("spill out", "spills_out"),
    ("spill in", "spills_in"),
    ("evicted", "evictions"),
    ("copied", "copies_out"),
)


def activity_table(stats: ClusterStats, *, fold: bool = False) -> Table:
    """What each node's tiers did since their agents started: lookups answered (hits), reads the
    agent served, moves under memory pressure, and the disk tier's compression ratio."""
    table = Table(header_style="bold", box=None, padding=(0, 1), pad_edge=False, collapse_padding=True)
    _name_column(table, "node", [n.node_id for n in stats.nodes], fold=fold)
    # Counters count from the agent's start: "up" says how long that is (a restart zeroes them).
    table.add_column("up", justify="right", no_wrap=True)
    table.add_column("tier", no_wrap=True)
    for name, _ in ACTIVITY:
        # Two-word headers fold onto two lines where the terminal is narrow ("spill" over "out"):
        # kept on one, the table needs ~85 columns and an 80-column pipe cut every header short.
        table.add_column(name, justify="right", no_wrap=" " not in name, min_width=len(max(name.split(), key=len)))
    table.add_column("ratio", justify="right", no_wrap=True)
    for node in stats.nodes:
        up = age(node.uptime_s) if node.started_ms else "-"
        for i, tier in enumerate(node.tiers):
            counts = [str(getattr(tier, field)) for _, field in ACTIVITY]
            ratio = f"{tier.compression_ratio:.2f}x" if tier.tier == "disk" else ""
            first = i == 0
            table.add_row(Text(node.node_id, "bold") if first else "", up if first else "", tier.tier, *counts, ratio)
    return table


def totals_line(stats: ClusterStats) -> Text:
    live = len(stats.live_nodes)
    return Text.assemble(
        ("nodes ", "dim"),
        f"{live}/{len(stats.nodes)} alive",
        ("   objects ", "dim"),
        str(stats.objects),
        ("   used ", "dim"),
        f"{format_size(stats.used_bytes)} / {format_size(stats.capacity_bytes)}",
        ("   gets ", "dim"),
        f"{stats.hits} hit / {stats.misses} miss",
        ("   evicted ", "dim"),
        str(stats.evictions),
        ("   corrupt ", "dim"),
        str(stats.corrupt),
        ("   short ", "dim"),
        str(stats.short),
    )


def cluster_view(stats: ClusterStats, *, header: Text | None = None) -> Group:
    parts: list[Any] = [header] if header is not None else []
    if stats.nodes:
        parts += [
            _Fitted(lambda fold: nodes_table(stats, fold=fold)),
            Text(""),
            _Fitted(lambda fold: activity_table(stats, fold=fold)),
            Text(""),
        ]
    else:
        parts.append(Text("no agents registered: start one with `mooncake agent` or `mooncake up`", "yellow"))
    parts.append(totals_line(stats))
    return Group(*parts)


def stats_json(stats: ClusterStats, *, redis_url: str, namespace: str) -> dict[str, Any]:
    data = stats.as_dict()
    data["nodes"] = list(data["nodes"])
    data["live_nodes"] = len(stats.live_nodes)
    data["redis_url"] = redis_url
    data["namespace"] = namespace
    return data
