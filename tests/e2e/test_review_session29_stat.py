"""`mooncake stat` in 80 columns, a terminal's or a pipe's (session 29 review): every column was
unwrappable, so rich cut each one short ("us-east…" for us-east-1a and us-east-1b alike, "8.0 M…",
endpoints, and with a long node id the spill columns gone). Names now fold and figures keep their
width; the common table still fits 80 columns as it did."""

from __future__ import annotations

import re
import uuid

from mooncake_store import LocalCluster, connect

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
