"""CLI, from a walk through the README (session 30): `mooncake stat` in a narrow terminal dropped
and cut columns though the README says no name or figure is cut short (58 columns: no "spill
out"; 55: no node column; 50: "… ti… rat…"), since rich squeezes the columns it may not wrap once
the wrappable ones are at one width; and a failing command whose stderr nobody read exited 1, its
own code lost to the error message's BrokenPipeError."""

from __future__ import annotations

import io
import os
import subprocess
from collections import Counter
from dataclasses import replace

import pytest
from helpers import mooncake_bin
from mooncake_cli import render
from rich.console import Console, RenderableType

from mooncake_store.client.stats import ClusterStats, NodeStats, TierStats

from .conftest import Mooncake

WIDE = 10_000


def _node(node_id: str, zone: str, endpoint: str, *, disk: bool) -> NodeStats:
    tiers = [TierStats(tier="host", capacity_bytes=1023 << 20, used_bytes=1000 << 20, objects=12345, demotions=123456)]
    if disk:
        tiers.append(
            TierStats(tier="disk", capacity_bytes=500 << 30, used_bytes=123 << 30, objects=9, compression_ratio=1.5)
        )
    return NodeStats(
        node_id=node_id, host="h", zone=zone, pid=1, alive=True, heartbeat_age_s=0.3, heartbeat_deadline_in_s=5,
        tcp_endpoint=endpoint, shm_name="", transports=("shm", "tcp"), objects=1, tiers=tuple(tiers), started_ms=1,
        uptime_s=3600,
    )  # fmt: skip


CLUSTERS = {
    "common": (
        _node("agent-0", "default", "127.0.0.1:44217", disk=False),
        _node("agent-1", "default", "127.0.0.1:33403", disk=False),
    ),
    "long names, disk": (
        _node("ip-10-0-12-34.ec2.internal-12345", "us-east-1a", "10.100.12.34:7601", disk=True),
        _node("gpu-node-02", "us-east-1b", "[fd00::7]:7000", disk=True),
    ),
    # A node with no tiers had no activity row (its uptime unseen), and a dangling "use" label in
    # the lines of pairs; a zone wider than the width folded to column 0, read as a node's name.
    "bare node, long zone": (
        _node("agent-0", "a-very-long-zone-name-of-a-rack", "127.0.0.1:40001", disk=False),
        replace(_node("bare", "z", "127.0.0.1:40002", disk=False), tiers=()),
    ),
}


def _text(renderable: RenderableType, width: int, *, soft_wrap: bool) -> str:
    # soft_wrap as `stat` prints (context.out); without, as `stat --watch`'s live view does (live_out).
    console = Console(width=width, record=True, soft_wrap=soft_wrap, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _chars(text: str) -> Counter[str]:
    return Counter(c for c in text if not c.isspace())


@pytest.mark.parametrize("name", list(CLUSTERS))
@pytest.mark.parametrize("soft_wrap", [True, False])
def test_stat_at_any_width_shows_every_character_of_its_tables_within_the_width(name: str, soft_wrap: bool) -> None:
    """Each part, at widths from 12 to 120, is the table or the lines of pairs with nothing
    left out (the same characters as that form at full width: folding only moves them), no
    line wider than the width, and no ellipsis."""
    stats = ClusterStats(nodes=CLUSTERS[name], objects=1, capacity_bytes=1, used_bytes=1, hits=0, misses=0)
    whole = {  # each part's characters in its two forms, at full width
        "nodes": (render.nodes_table(stats), render.nodes_lines(stats, WIDE)),
        "activity": (render.activity_table(stats), render.activity_lines(stats, WIDE)),
    }
    parts = {part: tuple(_chars(_text(form, WIDE, soft_wrap=True)) for form in forms) for part, forms in whole.items()}
    view = render.cluster_view(stats).renderables
    fitted = {"nodes": view[0], "activity": view[2]}
    forms_seen = set()
    for width in sorted({*range(12, 121, 4), 45, 50, 55, 58, 70, 79, 80, 81}):  # the widths the review met, too
        for part, (table, lines) in parts.items():
            text = _text(fitted[part], width, soft_wrap=soft_wrap)
            assert "…" not in text, (width, part, text)
            assert max(len(line.rstrip()) for line in text.splitlines()) <= width, (width, part, text)
            chars = _chars(text)
            form = "table" if chars == table else "lines"
            assert form == "table" or chars == lines, (width, part, text)
            if form == "lines":  # only a node's name starts at column 0, whole or folded
                starts = [line.split()[0] for line in text.splitlines() if line and not line[0].isspace()]
                assert all(any(start in n.node_id for n in CLUSTERS[name]) for start in starts), (width, text)
            forms_seen.add((part, form))
    assert ("nodes", "lines") in forms_seen and ("activity", "table") in forms_seen, forms_seen
    wide = _text(render.cluster_view(stats), WIDE, soft_wrap=True)
    assert all(f"{node.node_id} " in wide.split("\n\n")[1] for node in CLUSTERS[name]), wide  # a row each


def test_the_common_cluster_keeps_its_tables_in_80_columns() -> None:
    host = TierStats(tier="host", capacity_bytes=8 << 20, used_bytes=1 << 20, objects=3)
    nodes = tuple(replace(node, tiers=(host,)) for node in CLUSTERS["common"])
    stats = ClusterStats(nodes=nodes, objects=6, capacity_bytes=16 << 20, used_bytes=2 << 20, hits=0, misses=0)
    text = _text(render.cluster_view(stats), 80, soft_wrap=True)
    headers = [line.split() for line in text.splitlines() if line.startswith("node ")]
    assert len(headers) == 2, text  # both tables, not the lines of pairs
    assert headers[0][-2:] == ["hb", "age"] and headers[1][-3:] == ["evicted", "copied", "ratio"], text


def test_a_failed_command_keeps_its_exit_code_when_nobody_reads_its_stderr(mooncake: Mooncake) -> None:
    """`mooncake get nope 2>&1 | true` exited 1, not 4 (no cluster recorded) or 3."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes its error
    try:
        result = subprocess.run(
            [mooncake_bin(), "get", "nope"], stdout=subprocess.DEVNULL, stderr=write_end, env=mooncake.env, timeout=60
        )
    finally:
        os.close(write_end)
    assert result.returncode == 4  # cannot connect: no cluster is recorded in this state dir
