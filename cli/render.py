"""Tables for people: the cluster view shared by `stat`, `stat --watch` and the `up` live view,
and the key listing of `ls`."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from mooncake_store import ClusterStats, NodeStats
from mooncake_store.client.stats import TierStats
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
FOLD_MIN_WIDTH = {"node": 8, "zone": 8, "endpoint": 15, "via": 7, "key": 16, "dtype": 8}


def _name_column(table: Table, name: str, values: list[str], *, fold: bool) -> None:
    """A column of names: kept on their lines, or with ``fold`` folded onto further lines where
    the width runs short (never narrower than FOLD_MIN_WIDTH, or than its longest name)."""
    if fold:
        longest = max(map(len, values), default=len(name))
        table.add_column(name, overflow="fold", min_width=min(longest, FOLD_MIN_WIDTH[name]))
    else:
        # Its width as printed: rich measures a text by its str.splitlines() pieces, and a key
        # holding U+2028 or U+2029 (allowed: neither is C0 or C1) got a column the width of its
        # longest piece and was cut with "…", into a pipe too.
        table.add_column(name, no_wrap=True, min_width=max(map(cell_len, values), default=0))


class _Fitted:
    """A table laid out for the width it is printed in, with nothing cut short: as built, where
    it fits; else with each column set to a width that cuts nothing (name columns folding onto
    further lines, two-word headers on two), the room left going to the names first; else, in a
    width no table fits, as lines of "name value" pairs that wrap (``narrow``).

    With every column unwrappable, rich cut each one short where the table was too wide
    ("us-east…", "8.0 M…", the spill columns gone for a long node id), into a pipe's 80 columns
    too. Left to share out the width itself, rich squeezes columns it may not wrap (figures) once
    the wrappable ones are down to one width, and drops whole columns below that: in 58 columns
    "spill out" was gone, in 55 the node column."""

    def __init__(self, build: Callable[[bool], Table], narrow: Callable[[int], Text]) -> None:
        self._build = build
        self._narrow = narrow

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        unbounded = options.update_width(1 << 16)  # rich clamps a measure to the width given
        table = self._build(False)
        if Measurement.get(console, unbounded, table).maximum <= options.max_width:
            yield table
            return
        table = self._build(True)
        if _set_widths(console, unbounded, table, options.max_width):
            yield table
        else:
            yield self._narrow(options.max_width)


def _set_widths(console: Console, options: ConsoleOptions, table: Table, width: int) -> bool:
    """Give each column of ``table`` a fixed width that cuts nothing, within ``width`` if it can
    (False if not): a figure its whole width, a folding name or a two-word header its narrowest;
    then the room left to names, each step the one that makes a name whole for the fewest
    characters (as many names as can be stay whole), and last to two-word headers."""
    least: list[int] = []
    lengths: list[list[int]] = []  # of each cell, header included
    for column in table.columns:
        measured = [Measurement.get(console, options, cell) for cell in (column.header, *column.cells)]
        lengths.append([m.maximum for m in measured])
        if column.no_wrap:
            least.append(max(lengths[-1]))
        elif column.overflow == "fold":
            least.append(column.min_width or max(lengths[-1]))
        else:  # words wrap between lines: the longest one
            least.append(max(column.min_width or 0, *(m.minimum for m in measured)))
    gaps = len(table.columns) - 1  # padding (0, 1), collapsed, none at the edges: one space between
    spare = width - sum(least) - gaps
    if spare < 0:
        return False
    names = [i for i, column in enumerate(table.columns) if column.overflow == "fold"]
    while True:
        steps = [(n - least[i], i, n) for i in names for n in lengths[i] if least[i] < n <= least[i] + spare]
        if not steps:
            break
        cost, i, least[i] = min(steps)
        spare -= cost
    for i, column in enumerate(table.columns):
        if not column.no_wrap and column.overflow != "fold" and max(lengths[i]) - least[i] <= spare:
            spare -= max(lengths[i]) - least[i]
            least[i] = max(lengths[i])
    for column, fixed in zip(table.columns, least, strict=True):
        column.width = fixed
    return True


#: How far _pairs indents a node's further lines.
INDENT = "    "


def _pairs(name: Text, pairs: list[tuple[str, str | Text]], width: int) -> Text:
    """``name`` then "label value" pairs, as many to a line as ``width`` holds, further lines
    indented; a pair is never split between lines unless it is wider than an indented line by
    itself: then its label and the pieces of its value take indented lines of their own (folded
    at column 0, a value read as the next node's name). A pair with no value is left out."""
    room = width - len(INDENT)
    line, lines = name.copy(), []
    for label, value in pairs:
        if not (value.plain if isinstance(value, Text) else value):
            continue
        pair = Text.assemble((label + " ", "dim"), value)
        fresh = line.plain == INDENT
        if pair.cell_len > room and room >= 2 * len(INDENT):
            if not fresh:
                lines.append(line)
            for text in (Text(label, "dim"), value if isinstance(value, Text) else Text(value)):
                lines += [Text(INDENT) + piece for piece in text.wrap(_MEASURE, room, overflow="fold")]
            line = Text(INDENT)
            continue
        if not fresh and line.cell_len + 2 + pair.cell_len > width:
            lines.append(line)
            line, fresh = Text(INDENT), True
        if not fresh:
            line.append("  ")
        line.append_text(pair)
    if line.plain != INDENT:
        lines.append(line)
    # What is still too wide (a name wider than the line, or a width too narrow to indent in) folds.
    folded = [part for text in lines for part in text.wrap(_MEASURE, width, overflow="fold")]
    return Text("\n").join(folded)


#: Only measures text for _pairs' folding (Text.wrap asks a console for nothing else).
_MEASURE = Console(width=1 << 16, file=io.StringIO())


def _heartbeat(node: NodeStats) -> Text:
    """The heartbeat age, green while the node is inside its deadline, red once past it."""
    return Text(age(node.heartbeat_age_s) + ("" if node.alive else " dead"), "green" if node.alive else "red")


def _node_names(node: NodeStats) -> list[tuple[str, str | Text]]:
    # Text, not markup: "[fd00::7]:7000" is no style tag.
    return [("zone", Text(node.zone)), ("endpoint", Text(node.tcp_endpoint)), ("via", ",".join(node.transports))]


def _tier_use(tier: TierStats | None, node: NodeStats) -> list[tuple[str, str | Text]]:
    if tier is None:
        return [("used", "-"), ("capacity", "-"), ("use", ""), ("objs", str(node.objects))]
    return [
        ("used", format_size(tier.used_bytes)),
        ("capacity", format_size(tier.capacity_bytes)),
        ("use", use_percent(tier.used_bytes, tier.capacity_bytes)),
        ("objs", str(tier.objects)),  # what the tier holds
    ]


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
        for i, tier in enumerate(node.tiers or [None]):
            first = i == 0
            names = [value for _, value in _node_names(node)] if first else ["", "", ""]
            use = [value for _, value in _tier_use(tier, node)]
            table.add_row(
                Text(node.node_id, "bold") if first else "",
                *names,
                tier.tier if tier else "-",
                *use,
                _heartbeat(node) if first else "",
            )
    return table


def nodes_lines(stats: ClusterStats, width: int) -> Text:
    """The nodes table as lines of pairs, for a width no table fits."""
    lines: list[Text] = []
    for node in stats.nodes:
        lines.append(_pairs(Text(node.node_id, "bold"), [*_node_names(node), ("hb age", _heartbeat(node))], width))
        for tier in node.tiers or [None]:
            lines.append(_pairs(Text("  " + (tier.tier if tier else "-")), _tier_use(tier, node), width))
    return Text("\n").join(lines)


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


def _uptime(node: NodeStats) -> str:
    # Counters count from the agent's start: "up" says how long that is (a restart zeroes them).
    return age(node.uptime_s) if node.started_ms else "-"


def _activity(tier: TierStats) -> list[tuple[str, str | Text]]:
    counts: list[tuple[str, str | Text]] = [(name, str(getattr(tier, field))) for name, field in ACTIVITY]
    return [*counts, ("ratio", f"{tier.compression_ratio:.2f}x" if tier.tier == "disk" else "")]


def activity_table(stats: ClusterStats, *, fold: bool = False) -> Table:
    """What each node's tiers did since their agents started: lookups answered (hits), reads the
    agent served, moves under memory pressure, and the disk tier's compression ratio."""
    table = Table(header_style="bold", box=None, padding=(0, 1), pad_edge=False, collapse_padding=True)
    _name_column(table, "node", [n.node_id for n in stats.nodes], fold=fold)
    table.add_column("up", justify="right", no_wrap=True)
    table.add_column("tier", no_wrap=True)
    for name, _ in ACTIVITY:
        # Two-word headers fold onto two lines where the terminal is narrow ("spill" over "out"):
        # kept on one, the table needs ~85 columns and an 80-column pipe cut every header short.
        table.add_column(name, justify="right", no_wrap=" " not in name, min_width=len(max(name.split(), key=len)))
    table.add_column("ratio", justify="right", no_wrap=True)
    for node in stats.nodes:
        if not node.tiers:  # a row all the same, so that its uptime shows
            table.add_row(Text(node.node_id, "bold"), _uptime(node), "-", *([""] * (len(ACTIVITY) + 1)))
        for i, tier in enumerate(node.tiers):
            first = i == 0
            names = [Text(node.node_id, "bold"), _uptime(node)] if first else ["", ""]
            table.add_row(*names, tier.tier, *(value for _, value in _activity(tier)))
    return table


def activity_lines(stats: ClusterStats, width: int) -> Text:
    """The activity table as lines of pairs, for a width no table fits."""
    lines: list[Text] = []
    for node in stats.nodes:
        lines.append(_pairs(Text(node.node_id, "bold"), [("up", _uptime(node))], width))
        for tier in node.tiers:
            lines.append(_pairs(Text("  " + tier.tier), _activity(tier), width))
    return Text("\n").join(lines)


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
        ("   lost ", "dim"),
        str(stats.lost),
        ("   short ", "dim"),
        str(stats.short),
    )


def cluster_view(stats: ClusterStats, *, header: Text | None = None) -> Group:
    parts: list[Any] = [header] if header is not None else []
    if stats.nodes:
        parts += [
            _Fitted(lambda fold: nodes_table(stats, fold=fold), lambda width: nodes_lines(stats, width)),
            Text(""),
            _Fitted(lambda fold: activity_table(stats, fold=fold), lambda width: activity_lines(stats, width)),
            Text(""),
        ]
    else:
        parts.append(Text("no agents registered: start one with `mooncake agent` or `mooncake up`", "yellow"))
    parts.append(totals_line(stats))
    return Group(*parts)


#: One row of `ls`: key, size, dtype and shape, tiers, nodes, age.
KeyRow = tuple[str, str, str, str, str, str]
_KEY_COLUMNS = ("key", "size", "dtype", "tier", "node", "age")
_KEY_NAMES = frozenset({"key", "dtype", "node"})  # the rest are figures and tier names: never cut


def keys_table(rows: list[KeyRow], *, fold: bool = False) -> Table:
    table = Table(header_style="bold", box=None, pad_edge=False)
    for i, name in enumerate(_KEY_COLUMNS):
        if name in _KEY_NAMES:
            _name_column(table, name, [row[i] for row in rows], fold=fold)
        else:
            table.add_column(name, justify="right" if name in ("size", "age") else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # a key is text, never markup ("a[/b]")
    return table


def _rows_as_pairs(
    headers: Sequence[str], rows: Sequence[Sequence[str | Text]], width: int, *, names: int = 1, title: str = ""
) -> Text:
    """Each row as lines of "column value" pairs after its first ``names`` cells, for a width no
    table of them fits (_Fitted's narrow form)."""
    lines = list(Text(title).wrap(_MEASURE, width, overflow="fold")) if title else []
    for row in rows:
        name = Text(" ".join(map(str, row[:names])), "bold")
        lines.append(_pairs(name, list(zip(headers[names:], row[names:], strict=True)), width))
    return Text("\n").join(lines)


def keys_view(rows: list[KeyRow]) -> _Fitted:
    """The listing, nothing cut short: keys and node ids fold onto further lines where a terminal
    is too narrow (rich cut them with "…", and a key read back from the listing did not exist)."""
    return _Fitted(lambda fold: keys_table(rows, fold=fold), lambda width: _rows_as_pairs(_KEY_COLUMNS, rows, width))


def figures_view(table: Table, rows: list[list[str | Text]], *, names: int = 1) -> _Fitted:
    """A table of figures (``rows``, as built into ``table``), nothing cut short: where it does
    not fit the width, each row as lines of "column value" pairs after its first ``names`` cells
    (rich cut figures to "0.…" in 40 columns, and left out whole columns in fewer)."""
    headers = [str(column.header) for column in table.columns]
    title = str(table.title) if table.title else ""
    return _Fitted(lambda fold: table, lambda width: _rows_as_pairs(headers, rows, width, names=names, title=title))


def stats_json(stats: ClusterStats, *, redis_url: str, namespace: str) -> dict[str, Any]:
    data = stats.as_dict()
    data["nodes"] = list(data["nodes"])
    data["live_nodes"] = len(stats.live_nodes)
    data["redis_url"] = redis_url
    data["namespace"] = namespace
    return data
