"""`up --agents 0 --redis-url URL` records a cluster of no processes of its own. A later `up`
took that record for a dead cluster's and replaced it without a word, so the commands that found
the first cluster with no flags went to the new one. It is refused until `down` forgets it."""

from __future__ import annotations

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
