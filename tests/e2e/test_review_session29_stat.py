"""`mooncake stat` in 80 columns, a terminal's or a pipe's (session 29 review): every column was
unwrappable, so rich cut each one short ("us-east…" for us-east-1a and us-east-1b alike, "8.0 M…",
endpoints, and with a long node id the spill columns gone). Names now fold and figures keep their
width; the common table still fits 80 columns as it did."""

from __future__ import annotations

import os
import re
import uuid

from mooncake_cli.render import cluster_view
from rich.console import Console

from mooncake_store import LocalCluster, connect
from mooncake_store.client.stats import ClusterStats, NodeStats, TierStats

from .conftest import Mooncake

LONG_ID = "ip-10-0-12-34.ec2.internal-12345"


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
    for whole in ("us-east-1a", "us-east-1b", "gpu-node-02", "8.0 MiB", "hb age", "ratio", *endpoints):
        assert whole in text, (whole, text)
    assert re.search(r"spill\s+spill", text) and re.search(r"out\s+in", text), text
    # The long id folds in the first column: its pieces, line after line, spell it whole.
    pieces = [line.split()[0] for line in text.splitlines() if line.strip()]
    assert LONG_ID in "".join(pieces), text


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
    for whole in ("1000.0 MiB", "1023.0 MiB", "123456", "1.50x", "hb age", "ratio"):
        assert whole in text, (whole, text)
    assert re.search(r"us-east-\s.*\n.*1a", text) and re.search(r"gpu-node-0\s.*\n01", text), text
