"""`mooncake down`'s report counts the processes of the cluster it stopped, however they stopped."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from .conftest import HOST_MEM, Mooncake


def test_down_of_a_foreground_cluster_counts_every_process_it_stopped(
    mooncake: Mooncake, pid_alive: Callable[[int], bool]
) -> None:
    """A foreground `up` stops its own agents and server on `down`'s SIGTERM; the report counted only
    what was still running after that ("stopped 1 process(es)" for a whole cluster)."""
    proc = mooncake.popen("up", "--agents", "2", "--host-mem", HOST_MEM)
    try:
        deadline = time.monotonic() + 30
        while not (mooncake.state_dir / "cluster.json").exists() and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
        state = mooncake.state()
        pids = [int(a["pid"]) for a in state["agents"]] + [int(s["pid"]) for s in state["servers"]]
        mooncake.ok("put", "k", "-", stdin=b"v")  # up and serving
        down = mooncake.ok("down", "--timeout", "10")
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
            mooncake("down", "--timeout", "5")
    assert not any(pid_alive(p) for p in pids)
    found = re.search(rb"stopped (\d+) process", down.stdout)
    assert found is not None, down.stdout
    # The owner, its two agents and the embedded server (its wrapper and the server itself).
    assert int(found.group(1)) == 1 + len(pids), (down.stdout, len(pids))
