"""A burst of stop signals stops an agent, the embedded server's wrapper and `mooncake agent` at
once, and cleanly: their handlers set a threading.Event, whose lock is no re-entrant one, and a
signal that landed while the handler of the one before held it deadlocked the process for good.
LocalCluster's stop sends SIGTERM twice back to back, and about one agent stop in fifteen then
waited out its 10 s and was SIGKILLed (the suite's teardowns of exactly 10 s), its node left in the
index to be reaped and its arena to be removed by its launcher."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
from helpers import mooncake_bin, wait_until

from mooncake_store import Client, LocalCluster
from mooncake_store.tiers.host import SHM_DIR

#: Signals in one burst: enough that some land while the handler of one before still runs.
BURST = 300
#: How long a process is given to stop after its burst: a stop takes well under a second; a
#: deadlocked one never ends.
STOP_WITHIN_S = 20.0


def burst(pid: int, signums: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    for i in range(BURST):
        try:
            os.kill(pid, signums[i % len(signums)])
        except ProcessLookupError:
            return  # stopped already


def stops_cleanly(process: subprocess.Popen[bytes]) -> bool:
    """A burst of SIGTERMs to ``process``: True when it then exits 0 (a clean stop), False when it
    still runs STOP_WITHIN_S later (then killed)."""
    burst(process.pid)
    status = stopped(process)
    assert status in (None, 0), f"exit status {status} after a burst of stop signals"
    return status is not None


def stopped(process: subprocess.Popen[bytes]) -> int | None:
    """The exit status, or None when it still runs STOP_WITHIN_S after its burst (then killed)."""
    try:
        return process.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        return None


@pytest.mark.parametrize("signums", [(signal.SIGTERM,), (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)])
def test_agents_stop_cleanly_at_a_burst_of_stop_signals(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], signums: tuple[int, ...]
) -> None:
    cluster = make_cluster(6, host_bytes=4 << 20, agent_args=["--no-prefault"])
    client = make_client(cluster)
    assert wait_until(lambda: len(client.index.nodes()) == 6, 10), client.index.nodes()
    agents = list(cluster.agents)
    results = {}
    for agent in agents:
        burst(agent.pid, signums)
        results[agent.node_id] = stopped(agent.process)
    hung = [node for node, status in results.items() if status is None]
    assert not hung, f"agents still running {STOP_WITHIN_S} s after a burst of {BURST} signals: {hung}"
    assert all(status == 0 for status in results.values()), results
    # A clean stop deregisters (no reap needed) and removes the arena.
    assert client.index.nodes() == {}, client.index.nodes()
    assert not [a.shm_name for a in agents if (SHM_DIR / a.shm_name).exists()]


def test_the_embedded_server_wrapper_stops_at_a_burst_of_signals() -> None:
    hung = []
    for _ in range(4):
        wrapper = subprocess.Popen(
            [sys.executable, "-m", "mooncake_store.embedded"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        server_pid, temp_dir = 0, ""
        try:
            assert wrapper.stdout is not None and wrapper.stdout.readline().startswith(b"redis://")
            assert wrapper.stderr is not None
            line = b""
            while b", pid " not in line:  # "valkey 9.1.2, pid N, temp dir ..." (after any warning)
                line = wrapper.stderr.readline()
                assert line, "the wrapper ended before it named its server"
            server_pid = int(line.split(b", pid ")[1].split(b",")[0])
            temp_dir = line.split(b"temp dir ")[1].strip().decode() if b"temp dir " in line else ""
            if not stops_cleanly(wrapper):
                hung.append(wrapper.pid)
            else:  # its server went with it
                assert wait_until(lambda pid=server_pid: not os.path.exists(f"/proc/{pid}"), 10), server_pid
        finally:
            if wrapper.poll() is None:
                wrapper.kill()
                wrapper.wait(timeout=10)
                # A killed wrapper stops nothing: its server (the leader of a process group of its
                # own) and temp dir go here.
                if server_pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(server_pid, signal.SIGKILL)
                if temp_dir.startswith("/tmp/mooncake-redis-"):
                    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not hung, f"wrappers still running {STOP_WITHIN_S} s after a burst of {BURST} SIGTERMs: {hung}"


def test_mooncake_agent_stops_at_a_burst_of_signals(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0)
    client = make_client(cluster)
    hung = []
    for i in range(4):
        agent = subprocess.Popen(
            [
                *(mooncake_bin(), "--redis-url", cluster.redis_url, "--namespace", cluster.namespace, "agent"),
                *("--host-mem", "4MiB", "--no-prefault", "--node-id", f"burst-{i}", "--ready-json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")},
        )
        shm_name = ""
        try:
            assert agent.stdout is not None
            ready = agent.stdout.readline()
            assert ready.startswith(b"READY "), ready
            shm_name = json.loads(ready[len(b"READY ") :])["shm_name"]
            if not stops_cleanly(agent):
                hung.append(agent.pid)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=10)
            if shm_name:  # a killed agent cannot remove its own arena
                (SHM_DIR / shm_name).unlink(missing_ok=True)
    assert not hung, f"`mooncake agent` still running {STOP_WITHIN_S} s after a burst of {BURST} SIGTERMs: {hung}"
    assert client.index.nodes() == {}, client.index.nodes()  # each deregistered as it stopped
