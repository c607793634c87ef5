"""LocalCluster's processes: a private server that died before its launcher was killed outright
left its temp dir behind (the watchdog left as soon as the server was gone, and only the launcher's
own stop removed the dir; the watchdog now stays for the launcher); an agent's READY line read in
one pipe read with a line before it was not seen until the start timed out."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import wait_until

from mooncake_store import LocalCluster, watchdog

LAUNCHER = textwrap.dedent(
    """
    import time
    from mooncake_store import LocalCluster
    cluster = LocalCluster(0).start()  # its own private server, watched by a watchdog
    print(cluster.server.pid, cluster.server.temp_dir, cluster.server._watchdog.pid, flush=True)
    time.sleep(120)  # killed long before
    """
)


def test_the_server_temp_dir_goes_when_the_launcher_is_killed_after_its_server_died() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE)
    temp_dir = ""
    watchdog_pid = 0
    try:
        assert launcher.stdout is not None
        ready, _, _ = select.select([launcher.stdout], [], [], 60)
        assert ready, "the launcher did not start its cluster within 60 s"
        pid_text, temp_dir, watchdog_text = launcher.stdout.readline().decode().split()
        watchdog_pid = int(watchdog_text)
        os.kill(int(pid_text), signal.SIGKILL)  # the server dies (a crash, the OOM killer)
        assert wait_until(lambda: watchdog.start_time(int(pid_text)) is None, 10)
        time.sleep(2 * watchdog.POLL_S)  # the watchdog has seen it gone
        assert Path(temp_dir).exists()  # its log is kept while the launcher may still read it
        launcher.send_signal(signal.SIGKILL)  # then its launcher, which runs no cleanup
        launcher.wait(timeout=10)
        assert wait_until(lambda: not Path(temp_dir).exists(), 10), f"{temp_dir} was left behind"
        assert wait_until(lambda: watchdog.start_time(watchdog_pid) is None, 10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
        started = watchdog.start_time(watchdog_pid) if watchdog_pid else None
        if started is not None:  # the watch outlived its launcher: stopped here, by its pid
            os.kill(watchdog_pid, signal.SIGKILL)
        if temp_dir and Path(temp_dir).name.startswith("mooncake-redis-"):
            shutil.rmtree(temp_dir, ignore_errors=True)


HOLD_UNTIL_READY = """
import sys


class HoldUntilReady:
    # The agent's stdout, written to the pipe only with its READY line: what it printed before
    # arrives in the same read.
    def __init__(self, inner):
        self.inner, self.held = inner, []

    def write(self, text):
        self.held.append(text)
        return len(text)

    def flush(self):
        if any("READY" in text for text in self.held):
            self.inner.write("".join(self.held))
            self.held.clear()
            self.inner.flush()

    def __getattr__(self, name):
        return getattr(self.inner, name)


sys.stdout = HoldUntilReady(sys.stdout)
print("a line of its own before READY")
"""


def test_an_agent_line_before_ready_in_the_same_pipe_read_does_not_hide_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str, namespace: str
) -> None:
    """LocalCluster waited with select() on the pipe and read with a buffered readline(): a line
    the agent wrote before READY, in the same write, took READY into the file's buffer, and
    select() then waited out the whole start timeout for a pipe with nothing more in it."""
    (tmp_path / "sitecustomize.py").write_text(HOLD_UNTIL_READY)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    # The session's server: only the agent (no server wrapper) starts with the stdout above.
    cluster = LocalCluster(1, host_bytes=16 << 20, redis_url=redis_url, namespace=namespace, startup_timeout_s=20)
    try:
        cluster.start()  # ServerError "did not become ready within 20 s" before
        assert cluster.agents[0].endpoint
    finally:
        cluster.stop()


def test_a_server_started_again_after_it_died_leaves_no_watchdog_or_dir_of_the_run_before() -> None:
    """Its watchdog now stays for the launcher after the server dies (for the temp dir), so a start
    over the dead run left that watchdog and its dir behind, one more at every restart."""
    from mooncake_store.embedded import EmbeddedServer

    server = EmbeddedServer(exit_with_parent=True).start()
    try:
        first_watchdog, first_dir = server._watchdog, server.temp_dir
        assert first_watchdog is not None and first_dir is not None
        os.kill(server.pid, signal.SIGKILL)  # the server dies (a crash)
        assert wait_until(lambda: not server.running, 10)
        server.start()
        assert first_watchdog.poll() is not None  # stopped, by its pid
        assert not first_dir.exists()
        assert server._watchdog is not None and server._watchdog.poll() is None
    finally:
        server.stop()
