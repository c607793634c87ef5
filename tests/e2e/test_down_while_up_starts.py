"""`mooncake down` run while a detached `up` is still starting its processes."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from .conftest import HOST_MEM, Mooncake


def _up_holds_its_lock(state_dir: Path) -> bool:
    try:
        fd = os.open(state_dir / "up.lock", os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_down_while_up_is_starting_waits_for_the_cluster_and_stops_it(
    mooncake: Mooncake, pid_alive: Callable[[int], bool]
) -> None:
    """Until `up --detach` has started every process it records nothing, and `down` in that window
    said "nothing to stop" (exit 0) while the cluster came up behind it. `down` now sees the `up`
    holding the state directory's lock, waits for the record, and stops what it names."""
    up = mooncake.popen("up", "--detach", "--agents", "2", "--host-mem", HOST_MEM, "--json")
    try:
        deadline = time.monotonic() + 30
        while not _up_holds_its_lock(mooncake.state_dir) and up.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not (mooncake.state_dir / "cluster.json").exists(), "the window was missed: already recorded"
        assert up.poll() is None, "`up` ended before `down` could run while it started"
        down = mooncake("down", "--timeout", "5", timeout=180)
        stdout, stderr = up.communicate(timeout=180)
        assert up.returncode == 0, stderr.decode(errors="replace")
        state = json.loads(stdout)
        pids = [int(a["pid"]) for a in state["agents"]] + [int(s["pid"]) for s in state["servers"]]
        assert down.returncode == 0, down.stderr.decode(errors="replace")
        assert "nothing to stop" not in down.stderr.decode(), down.stderr.decode()
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(pid_alive(p) for p in pids), "processes of the cluster outlived `down`"
        assert not any((Path("/dev/shm") / s).exists() for s in state["shm_segments"])
        assert not (mooncake.state_dir / "cluster.json").exists()
    finally:
        if up.poll() is None:
            up.communicate(timeout=180)
        mooncake("down", "--timeout", "5")  # whatever it recorded is stopped, should the test fail
