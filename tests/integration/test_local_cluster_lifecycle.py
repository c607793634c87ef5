"""LocalCluster's processes and the terminal: a Ctrl-C the caller catches, a hang-up, a cluster
stopped and started again, and values its agents would refuse. Real agent processes, each stopped
by its own pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from mooncake_store import ConfigError, LocalCluster, MooncakeError, connect
from mooncake_store.tiers.host import SHM_DIR

MiB = 1 << 20


def test_a_ctrl_c_the_caller_catches_leaves_the_agents_running(redis_url: str) -> None:
    """A terminal's Ctrl-C goes to its whole foreground process group: the agents were in the
    caller's, and a REPL or script that caught the KeyboardInterrupt went on with every agent
    stopped and its objects lost."""
    script = textwrap.dedent(
        f"""
        import os, signal, time
        import numpy as np
        from mooncake_store import LocalCluster, connect
        with LocalCluster(2, redis_url={redis_url!r}, host_bytes=16 << 20) as cluster:
            client = connect(cluster.redis_url, namespace=cluster.namespace)
            client.put("kv", np.arange(1000, dtype=np.int64))
            try:
                os.killpg(0, signal.SIGINT)  # as the terminal does on Ctrl-C
                time.sleep(5)
            except KeyboardInterrupt:
                pass
            time.sleep(0.5)
            print("alive", [a.alive() for a in cluster.agents], flush=True)
            print("same", bool(np.array_equal(client.get("kv"), np.arange(1000, dtype=np.int64))), flush=True)
            client.close()
        """
    )
    # A session of its own, so that its killpg reaches nothing of this test run.
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, start_new_session=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "alive [True, True]" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "same True" in done.stdout, done.stdout


def test_a_hang_up_stops_an_agent_cleanly(make_cluster: Callable[..., LocalCluster]) -> None:
    """SIGHUP (its terminal closed) killed an agent by the default action: no stop ran, and its
    arena stayed in /dev/shm."""
    cluster = make_cluster(1, host_bytes=16 * MiB)
    agent = cluster.agents[0]
    assert (SHM_DIR / agent.shm_name).exists()
    os.kill(agent.pid, signal.SIGHUP)
    assert agent.process.wait(timeout=30) == 0
    assert not (SHM_DIR / agent.shm_name).exists(), "its arena was left in /dev/shm"


def test_a_stopped_cluster_starts_again_with_only_its_new_agents(redis_url: str) -> None:
    cluster = LocalCluster(2, redis_url=redis_url, host_bytes=16 * MiB)
    try:
        with cluster:
            first = [a.pid for a in cluster.agents]
        assert cluster.agents == []
        with cluster:  # "LocalCluster is not started" before, or the old, dead agents listed
            assert len(cluster.agents) == 2 and all(a.alive() for a in cluster.agents)
            assert cluster.agent("agent-0").pid not in first
            client = connect(cluster.redis_url, namespace=cluster.namespace)
            try:
                client.put("again", b"x" * 100)
                assert bytes(client.get("again")) == b"x" * 100
            finally:
                client.close()
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"heartbeat_ttl_s": 0}, "heartbeat_ttl_s"),
        ({"heartbeat_ttl_s": 1e6}, "heartbeat_ttl_s=1000000.0: must be >= 0.001 s and <= 86400 s"),
        ({"reserve_timeout_s": -1}, "reserve_timeout_s"),
        ({"zones": ["a b"]}, "zone"),
        ({"zones": []}, "zones"),
        ({"namespace": "x/y"}, "namespace"),
        ({"startup_timeout_s": 0}, "startup_timeout_s"),
        # By type: each was taken as given, and failed with a TypeError once the server had started
        # (zones="ab" was split into zones "a" and "b").
        ({"redis_url": 5}, "redis_url=5"),
        ({"redis_url": "http://x"}, "redis_url='http://x': scheme"),
        ({"zones": "ab"}, "zones must be a non-empty list"),
        ({"agent_args": "--x"}, "agent_args must be a list of str"),
        ({"log_dir": 123}, "log_dir must be a path"),
    ],
)
def test_values_the_agents_would_refuse_are_refused_before_anything_starts(
    kwargs: dict[str, object], named: str
) -> None:
    # ConfigError, as for every other bad argument (num_agents, the TTL, the timeout and an empty
    # zones list were the bare MooncakeError, which `except ConfigError` did not catch).
    with pytest.raises(ConfigError, match=named):
        LocalCluster(1, **kwargs)  # type: ignore[arg-type]


def test_an_agent_that_exits_as_it_starts_is_said_to_have_exited(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(0, host_bytes=16 * MiB)
    with pytest.raises(MooncakeError, match="exited with status 2 as it started") as info:
        cluster.add_agent(node_id="bad", extra_args=["--high-watermark", "7"])
    assert "did not become ready" not in str(info.value)
    assert cluster.agents == []


def test_with_a_log_dir_an_agent_that_exits_as_it_starts_is_said_to_have_exited_and_why(tmp_path: Path) -> None:
    """With log_dir the agent's log was opened for appending only, and reading its tail for the
    message failed with a bare OSError (Bad file descriptor) in place of the agent's reason."""
    with LocalCluster(0, host_bytes=16 * MiB, log_dir=tmp_path) as cluster:
        with pytest.raises(MooncakeError, match=r"exited with status 2 as it started.*--high-watermark") as info:
            cluster.add_agent(node_id="bad", extra_args=["--high-watermark", "7"])
        assert "did not become ready" not in str(info.value)
    assert "--high-watermark" in (tmp_path / "bad.log").read_text()


@pytest.mark.parametrize(("node_id", "zone"), [("../escape", None), ("a~b", None), ("ok", "a b")])
def test_add_agent_refuses_a_node_id_or_zone_the_agent_would_before_anything_starts(
    tmp_path: Path, node_id: str, zone: str | None
) -> None:
    """The log file was named after the node id before the agent checked it: "../escape" wrote
    outside log_dir, and a refusal came back as the agent's exit (or a raw OSError) rather than a
    ConfigError naming the value."""
    logs = tmp_path / "logs"
    with LocalCluster(0, host_bytes=16 * MiB, log_dir=logs) as cluster:
        with pytest.raises(ConfigError, match=r"node_id=|zone="):
            cluster.add_agent(node_id=node_id, zone=zone)
        assert cluster.agents == []
    assert not (tmp_path / "escape.log").exists()
