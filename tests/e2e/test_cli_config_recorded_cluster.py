"""`mooncake config` with no URL given shows what the other commands use: the URL and namespace of
the cluster `mooncake up` recorded. It showed no URL and namespace "default" (from the default),
while `ls`, `get` and `put` worked in the recorded cluster's own namespace."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from .conftest import Mooncake


@pytest.fixture
def recorded(mooncake: Mooncake) -> Iterator[Mooncake]:
    """A recorded cluster (its embedded server alone: no agent is needed here) in namespace "rec-ns"."""
    try:
        mooncake.ok("up", "--detach", "--agents", "0", "--namespace", "rec-ns")
        yield mooncake
    finally:
        mooncake("down", "--timeout", "5")


def test_config_shows_the_recorded_cluster_s_url_and_namespace(recorded: Mooncake) -> None:
    state = recorded.state()
    values = json.loads(recorded.ok("config", "--json").stdout)["values"]
    where = f"state file {recorded.state_dir / 'cluster.json'}"
    assert values["namespace"] == {"value": "rec-ns", "source": where}
    assert values["redis_url"] == {"value": state["redis_url"], "source": where}
    # The namespace the other commands use: `ls` lists the recorded namespace, as config says.
    listed = recorded.ok("ls")
    assert b"in namespace rec-ns" in listed.stdout + listed.stderr


def test_a_namespace_given_still_wins_over_the_recorded_one(recorded: Mooncake) -> None:
    env = {"MOONCAKE_NAMESPACE": "from-env"}
    values = json.loads(recorded.ok("config", "--json", env=env).stdout)["values"]
    assert values["namespace"] == {"value": "from-env", "source": "env MOONCAKE_NAMESPACE"}
    values = json.loads(recorded.ok("--namespace", "default", "config", "--json").stdout)["values"]
    assert values["namespace"] == {"value": "default", "source": "--namespace"}
