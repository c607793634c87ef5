"""A LocalCluster's private server that died before its launcher was killed outright: its temp dir
went with neither (the watchdog left as soon as the server was gone, and only the launcher's own
stop removed the dir). The watchdog now stays for the launcher and removes the dir once it is gone."""

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

from helpers import wait_until

from mooncake_store import watchdog

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
