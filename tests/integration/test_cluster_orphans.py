"""A LocalCluster's agents do not outlive the process that started them: killed with SIGKILL, the
launcher runs no cleanup, and its agents (re-parented) notice and stop as on SIGTERM, removing
their shared-memory arenas."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import wait_until

LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from mooncake_store import LocalCluster
    cluster = LocalCluster(1, redis_url=sys.argv[1], host_bytes=16 << 20).start()
    agent = cluster.agents[0]
    print(agent.process.pid, agent.shm_name, flush=True)
    time.sleep(120)  # killed long before
    """
)


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_agents_stop_when_their_launcher_is_killed(redis_url: str) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, redis_url], stdout=subprocess.PIPE)
    agent_pid = 0
    try:
        assert launcher.stdout is not None
        ready, _, _ = select.select([launcher.stdout], [], [], 60)
        assert ready, "the launcher did not start its cluster within 60 s"
        pid_text, shm_name = launcher.stdout.readline().decode().split()
        agent_pid = int(pid_text)
        segment = Path("/dev/shm") / shm_name
        assert running(agent_pid) and segment.exists()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        assert wait_until(lambda: not running(agent_pid), 15), "the agent outlived its killed launcher"
        assert not segment.exists(), "the agent left its arena behind"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
        if agent_pid and running(agent_pid):
            os.kill(agent_pid, signal.SIGKILL)  # by its PID: the test started it, through the launcher


SERVER_LAUNCHER = textwrap.dedent(
    """
    import time
    from mooncake_store import LocalCluster
    cluster = LocalCluster(0).start()  # its own private server
    print(cluster.server.pid, cluster.server.temp_dir, cluster.server._watchdog.pid, flush=True)
    time.sleep(120)  # killed long before
    """
)


def test_the_private_server_stops_when_its_launcher_is_killed() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", SERVER_LAUNCHER], stdout=subprocess.PIPE)
    server_pid = watchdog_pid = 0
    try:
        assert launcher.stdout is not None
        ready, _, _ = select.select([launcher.stdout], [], [], 60)
        assert ready, "the launcher did not start its cluster within 60 s"
        pid_text, temp_dir, watchdog_text = launcher.stdout.readline().decode().split()
        server_pid, watchdog_pid = int(pid_text), int(watchdog_text)
        assert running(server_pid) and running(watchdog_pid) and Path(temp_dir).is_dir()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        assert wait_until(lambda: not running(server_pid), 15), "the server outlived its killed launcher"
        assert wait_until(lambda: not running(watchdog_pid), 10), "the watchdog did not end after the server"
        assert not Path(temp_dir).exists(), "the server's temp dir was left behind"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
        for pid in (server_pid, watchdog_pid):  # by PID: the test started them, through the launcher
            if pid and running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_stopped_cluster_leaves_no_watchdog() -> None:
    from mooncake_store import LocalCluster

    cluster = LocalCluster(0).start()
    try:
        assert cluster.server is not None and cluster.server._watchdog is not None
        server_pid, watchdog_pid = cluster.server.pid, cluster.server._watchdog.pid
        assert running(watchdog_pid)
    finally:
        cluster.stop()
    assert not running(server_pid) and not running(watchdog_pid)
