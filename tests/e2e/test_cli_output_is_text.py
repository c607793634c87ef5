"""What the CLI prints is what was stored or asked: keys and endpoints are text (never rich markup
or emoji codes), --json is a document any parser reads, and output into a pipe arrives as drawn."""

from __future__ import annotations

import json
import os
import select
import subprocess
from pathlib import Path

from helpers import interrupt, mooncake_bin
from mooncake_cli.render import cluster_view
from rich.console import Console

from mooncake_store.client.stats import ClusterStats, NodeStats, TierStats

from .conftest import Mooncake

ODD_KEYS = ["a[/b]", "[red]markup[/red]", "e:smile:x"]


def test_keys_are_listed_and_named_as_they_are(cluster_cli: Mooncake) -> None:
    """`ls` passed keys to the table as markup: "a[/b]" ended every listing holding it with an
    internal MarkupError, "[red]markup[/red]" was listed as "markup", and ":smile:" as an emoji,
    in `put`'s line and in error messages too."""
    for key in ODD_KEYS:
        put = cluster_cli.ok("put", key, "-", stdin=b"x")
        assert f"put {key} (" in put.stderr.decode()
    try:
        listed = cluster_cli.ok("ls", "--limit", "100000").stdout.decode()
        for key in ODD_KEYS:
            assert key in listed, listed
        missing = cluster_cli("rm", "nope:smile:")
        assert missing.returncode == 3 and "nope:smile:" in missing.stderr.decode(), missing.stderr
    finally:
        cluster_cli("rm", *ODD_KEYS)


def test_json_stays_json_when_colour_is_forced(cluster_cli: Mooncake) -> None:
    """print_json coloured the document under FORCE_COLOR even into a pipe: no parser read it."""
    env = {"FORCE_COLOR": "1"}
    for command in (["ls", "--json"], ["stat", "--json"], ["doctor", "--json"]):
        result = cluster_cli(*command, env=env)
        assert result.returncode in (0, 1), result.stderr  # doctor: 1 when a check fails
        json.loads(result.stdout)


def test_a_listing_cut_by_its_limit_says_so_in_json_mode_too(cluster_cli: Mooncake) -> None:
    keys = [f"cut-{i}" for i in range(3)]
    for key in keys:
        cluster_cli.ok("put", key, "-", stdin=b"x")
    try:
        result = cluster_cli.ok("ls", "cut-*", "--json", "--limit", "2")
        assert len(json.loads(result.stdout)) == 2
        assert "limit 2 reached" in result.stderr.decode()
    finally:
        cluster_cli("rm", *keys)


def test_stat_watch_into_a_pipe_prints_each_refresh(cluster_cli: Mooncake) -> None:
    """A live display into a pipe printed nothing until it stopped: `mooncake stat -w | head`
    never ended. Into a pipe each refresh is a block printed as soon as it is drawn."""
    proc = subprocess.Popen(
        [mooncake_bin(), "stat", "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cluster_cli.env,
    )
    try:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], 20)
        assert readable, "nothing arrived on the pipe in 20 s (refreshing every 0.2 s)"
        first = proc.stdout.readline()
        assert first.strip(), proc.stderr.read() if proc.poll() is not None and proc.stderr else first
    finally:
        interrupt(proc, timeout_s=10)


def test_bad_input_on_the_command_line_is_a_usage_error(cluster_cli: Mooncake) -> None:
    """A non-UTF-8 pattern, an endless interval and a host name no resolver takes were internal
    errors (exit 1) or a server out of reach (exit 4)."""
    pattern = os.fsdecode(b"a\xff*")  # what the shell hands over for $'a\xff*'
    cases = {
        ("ls", pattern): "not valid UTF-8",
        ("stat", "--watch", "--interval", "inf"): "'inf' is not a finite number of seconds (from 0.1 to 3600)",
        # nan failed every comparison, and was called too large ("should be <= 600")
        ("bench", "--seconds", "nan"): "'nan' is not a finite number of seconds (from 0.01 to 600)",
        ("bench", "--seconds", "1e9"): "1e9 seconds is outside 0.01 to 600",
        ("down", "--timeout", "inf"): "'inf' is not a finite number of seconds",  # SIGKILL never came
        ("up", "--timeout", "abc"): "'abc' is not a number of seconds",
        ("ls", "--redis-url", "redis://a..b:6379/0"): "--redis-url='redis://a..b:6379/0': host 'a..b'",
    }
    for args, fragment in cases.items():
        result = cluster_cli(*args)
        assert result.returncode == 2, (args, result.returncode, result.stderr)
        assert fragment in result.stderr.decode(errors="replace"), (args, result.stderr)


def test_the_bare_command_prints_its_help_once(cluster_cli: Mooncake) -> None:
    result = cluster_cli()
    assert result.returncode == 0 and result.stdout.decode().count("Usage: mooncake") == 1, result.stdout


def test_a_closed_stdout_is_no_traceback(cluster_cli: Mooncake) -> None:
    """`mooncake get k >&-`: stdout is None in the interpreter, and the check of it raised."""
    result = subprocess.run(
        ["bash", "-c", 'exec "$0" ls >&-', mooncake_bin()], capture_output=True, env=cluster_cli.env, timeout=60
    )
    assert b"Traceback" not in result.stderr, result.stderr


def test_the_config_files_namespace_comes_before_the_recorded_clusters(cluster_cli: Mooncake, tmp_path: Path) -> None:
    """The README's order is file < env < flags; with a recorded cluster the file's namespace was
    passed over for the recorded one, while MOONCAKE_NAMESPACE was honoured."""
    config = tmp_path / "mooncake" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('namespace = "from-the-file"\n')
    result = cluster_cli.ok("stat", "--json", env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert json.loads(result.stdout)["namespace"] == "from-the-file"


def live_node(node_id: str, endpoint: str, tiers: tuple[TierStats, ...], *, objects: int = 0) -> NodeStats:
    """A node row as stat() builds it, for rendering without a cluster."""
    return NodeStats(
        node_id=node_id,
        host="h",
        zone="default",
        pid=1,
        alive=True,
        heartbeat_age_s=0.1,
        heartbeat_deadline_in_s=4,
        tcp_endpoint=endpoint,
        shm_name="",
        transports=("tcp",),
        objects=objects,
        tiers=tiers,
    )


def test_ipv6_endpoints_are_shown_whole_in_the_node_table() -> None:
    """An endpoint such as "[fd00::7]:7000" was read as a style tag and shown as ":7000"."""
    tier = TierStats(tier="host", capacity_bytes=1 << 20, used_bytes=0, objects=0)
    nodes = tuple(
        live_node(f"n{i}", endpoint, (tier,)) for i, endpoint in enumerate(["[fd00::7]:7000", "[abcd:ef::1]:7002"])
    )
    stats = ClusterStats(nodes=nodes, objects=0, capacity_bytes=2 << 20, used_bytes=0, hits=0, misses=0)
    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(cluster_view(stats))
    shown = console.export_text()
    assert "[fd00::7]:7000" in shown and "[abcd:ef::1]:7002" in shown, shown


def test_the_node_table_counts_objects_per_tier() -> None:
    """The node's count across its tiers was shown on its first tier's row: a host tier of 6
    objects above a disk tier of 4 read "10" and "" (the README says per node and tier)."""
    tiers = (
        TierStats(tier="host", capacity_bytes=8 << 20, used_bytes=6 << 20, objects=6),
        TierStats(tier="disk", capacity_bytes=64 << 20, used_bytes=1 << 20, objects=4),
    )
    node = live_node("n0", "127.0.0.1:7000", tiers, objects=10)
    stats = ClusterStats(nodes=(node,), objects=10, capacity_bytes=72 << 20, used_bytes=7 << 20, hits=0, misses=0)
    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(cluster_view(stats))
    shown = console.export_text()
    rows = [line.split() for line in shown.splitlines()]
    host_row = next(r for r in rows if r[:1] == ["n0"] and "host" in r)
    disk_row = next(r for r in rows if r[:1] == ["disk"])
    assert host_row[host_row.index("75%") + 1] == "6" and disk_row[disk_row.index("2%") + 1] == "4", rows
    assert "corrupt 0" in shown
