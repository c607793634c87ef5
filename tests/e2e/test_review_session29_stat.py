"""`mooncake stat` in 80 columns, a terminal's or a pipe's (session 29 review): every column was
unwrappable, so rich cut each one short ("us-east…" for us-east-1a and us-east-1b alike, "8.0 M…",
endpoints, and with a long node id the spill columns gone). Names now fold and figures keep their
width; the common table still fits 80 columns as it did."""

from __future__ import annotations

import os
import uuid

from mooncake_cli.render import cluster_view
from rich.console import Console

from mooncake_store import LocalCluster, connect
from mooncake_store.client.stats import ClusterStats, NodeStats, TierStats

from .conftest import Mooncake

LONG_ID = "ip-10-0-12-34.ec2.internal-12345"


def spelled(text: str, word: str) -> bool:
    """``word`` is in ``text`` whole, or folded: its pieces start at one column on lines one
    after another (a table's name column)."""
    if word in text:
        return True
    lines = text.splitlines()
    for first, line in enumerate(lines):
        for column in range(len(line)):
            rest, at = word, first
            while rest and at < len(lines):
                piece = lines[at][column:].split(" ")[0]
                if not piece or not rest.startswith(piece):
                    break
                rest, at = rest[len(piece) :], at + 1
            if not rest:
                return True
    return False


def _stat_in_80_columns(mooncake: Mooncake, cluster: LocalCluster) -> str:
    url, namespace = cluster.redis_url, cluster.namespace
    result = mooncake.ok("stat", "--redis-url", url, "--namespace", namespace, env={"COLUMNS": "80"})
    return result.stdout.decode()


def test_stat_in_80_columns_cuts_no_name_and_no_figure(mooncake: Mooncake) -> None:
    with LocalCluster(num_agents=0, host_bytes=8 << 20, namespace=f"t-{uuid.uuid4().hex[:10]}") as cluster:
        cluster.add_agent(node_id=LONG_ID, zone="us-east-1a")
        cluster.add_agent(node_id="gpu-node-02", zone="us-east-1b")
        with connect(cluster.redis_url, namespace=cluster.namespace) as client:
            client.put("x", b"abc")
        text = _stat_in_80_columns(mooncake, cluster)
        endpoints = [agent.endpoint for agent in cluster.agents]
    assert "…" not in text, text
    table_lines = [line for line in text.splitlines() if not line.startswith(("nodes ", "index "))]
    assert max(len(line.rstrip()) for line in table_lines) <= 80, text
    # Whole, or folded onto further lines (a table's name column, session 30's layout rule).
    for word in ("us-east-1a", "us-east-1b", "gpu-node-02", "8.0 MiB", "hb", "age", "evicted", LONG_ID, *endpoints):
        assert spelled(text, word), (word, text)


def test_the_common_table_still_fits_80_columns(mooncake: Mooncake) -> None:
    with LocalCluster(num_agents=2, host_bytes=8 << 20, namespace=f"t-{uuid.uuid4().hex[:10]}") as cluster:
        text = _stat_in_80_columns(mooncake, cluster)
    table_lines = [line for line in text.splitlines() if not line.startswith("nodes ")]  # totals wrap at will
    assert max(len(line.rstrip()) for line in table_lines) <= 80, text
    assert "…" not in text, text


def _node(node_id: str, zone: str, endpoint: str) -> NodeStats:
    tiers = (
        TierStats(tier="host", capacity_bytes=1023 << 20, used_bytes=1000 << 20, objects=12345, demotions=123456),
        TierStats(tier="disk", capacity_bytes=500 << 30, used_bytes=123 << 30, objects=99999, compression_ratio=1.5),
    )
    return NodeStats(
        node_id=node_id, host="h", zone=zone, pid=1, alive=True, heartbeat_age_s=0.3, heartbeat_deadline_in_s=5,
        tcp_endpoint=endpoint, shm_name="", transports=("shm", "tcp"), objects=1, tiers=tiers, started_ms=1,
        uptime_s=3600,
    )  # fmt: skip


def test_names_that_each_fit_but_not_together_fold_rather_than_being_cut() -> None:
    """Folding was chosen per column (a name past its own limit): names each under theirs, with
    wide figures beside them, were all cut short as before (second look at the change)."""
    nodes = (
        _node("gpu-node-001", "us-east-1a", "10.100.12.34:7601"),
        _node("gpu-node-002", "us-east-1b", "10.100.12.35:7601"),
    )
    stats = ClusterStats(nodes=nodes, objects=1, capacity_bytes=1, used_bytes=1, hits=0, misses=0)
    console = Console(width=80, record=True, soft_wrap=True, file=open(os.devnull, "w"))  # noqa: SIM115  (as `out` is)
    console.print(cluster_view(stats))
    text = console.export_text()
    assert "…" not in text, text
    for word in ("1000.0 MiB", "1023.0 MiB", "123456", "1.50x", "hb age", "ratio", "us-east-1a", "gpu-node-001"):
        assert spelled(text, word), (word, text)
