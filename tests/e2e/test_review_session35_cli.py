"""`up --agents 0 --redis-url URL` records a cluster of no processes of its own. A later `up`
took that record for a dead cluster's and replaced it without a word, so the commands that found
the first cluster with no flags went to the new one. It is refused until `down` forgets it."""

from __future__ import annotations

import json
import select
import signal

from .conftest import Mooncake


def test_up_over_a_recorded_cluster_of_no_processes_is_refused(mooncake: Mooncake, redis_url: str) -> None:
    mooncake.ok("up", "--detach", "--agents", "0", "--redis-url", redis_url, "--namespace", "rv35-first")
    before = mooncake.state()
    again = mooncake("up", "--detach", "--agents", "0")
    try:
        assert again.returncode == 1, again.stdout + again.stderr
        assert b"no processes of its own" in again.stderr and b"mooncake down" in again.stderr, again.stderr
        assert mooncake.state() == before  # still the first cluster's record
    finally:
        mooncake("down", "--timeout", "5")  # stops what the refused `up` started, were it not refused
    assert not (mooncake.state_dir / "cluster.json").exists()
    mooncake.ok("up", "--detach", "--agents", "0", "--redis-url", redis_url, "--namespace", "rv35-second")
    try:
        assert mooncake.state()["namespace"] == "rv35-second"
    finally:
        mooncake.ok("down", "--timeout", "5")


def test_commands_find_a_recorded_cluster_of_no_processes_with_no_flags(mooncake: Mooncake, redis_url: str) -> None:
    """Recorded with no process of its own, it was taken for a cluster no longer running: `stat`,
    `ls`, `put` and `doctor` failed with exit 4 ("run `mooncake down`"), and `mooncake agent`
    asked for --redis-url, though the README says every later command finds it with no flags."""
    mooncake.ok("up", "--detach", "--agents", "0", "--redis-url", redis_url, "--namespace", "rv35-found")
    agent = mooncake.popen("agent", "--host-mem", "16MiB", "--node-id", "rv35-joined", "--ready-json")
    try:
        assert agent.stdout is not None
        ready, _, _ = select.select([agent.stdout], [], [], 30)
        line = agent.stdout.readline().decode() if ready else ""
        assert line.startswith("READY "), (line, agent.poll())
        stat = json.loads(mooncake.ok("stat", "--json").stdout)
        assert stat["namespace"] == "rv35-found" and [n["node_id"] for n in stat["nodes"]] == ["rv35-joined"]
        mooncake.ok("put", "found/k", "-", stdin=b"abc")
        assert mooncake.ok("get", "found/k", "-").stdout == b"abc"
        assert "found/k" in mooncake.ok("ls").stdout.decode()
        mooncake.ok("rm", "found/k")
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=20)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        mooncake.ok("down", "--timeout", "5")
