"""A detached `mooncake up` stopped by a signal that lands once its cluster is recorded (while it
removes its starting record): it exited 143 saying "everything it started was stopped" while
cluster.json stayed and its server and agents ran on. The message is made true: what it started
is stopped and both records are removed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mooncake_cli.procs import alive
from mooncake_cli.state import ClusterState

from .conftest import Mooncake

# Runs the CLI with one change: a SIGTERM arrives just as `up --detach` has recorded its cluster
# and removes its starting record, as a `kill` at that moment would. What was recorded is copied
# aside first, so the test knows which processes to look for once the file is gone.
SIGNAL_AFTER_RECORD = """
import os, shutil, signal, sys
from mooncake_cli.commands import cluster

real = cluster.clear_starting
recorded_copy = sys.argv[1]
sent = []

def clear_starting_with_a_signal_arriving():
    if not sent and cluster.state_path().exists():
        sent.append(True)
        shutil.copyfile(cluster.state_path(), recorded_copy)
        os.kill(os.getpid(), signal.SIGTERM)
    real()

cluster.clear_starting = clear_starting_with_a_signal_arriving
from mooncake_cli.entry import main
sys.argv = ["mooncake", *sys.argv[2:]]
main()
"""


def test_a_signal_once_the_cluster_is_recorded_stops_it(mooncake: Mooncake, tmp_path: Path) -> None:
    recorded = tmp_path / "recorded.json"
    up_args = ["up", "--detach", "-n", "1", "--host-mem", "8MiB"]
    try:
        up = subprocess.run(
            [sys.executable, "-c", SIGNAL_AFTER_RECORD, str(recorded), *up_args],
            env=mooncake.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert recorded.exists(), up.stderr  # the signal was sent once cluster.json was written
        state = ClusterState.from_dict(json.loads(recorded.read_text()))
        assert up.returncode == 143, up.stderr
        assert "everything it started was stopped" in up.stderr, up.stderr
        assert state.agents and state.servers
        running = [ref.pid for ref in [*state.servers, *(a.proc for a in state.agents)] if alive(ref)]
        assert running == [], f"reported stopped, yet pid(s) {running} run on"
        assert not (mooncake.state_dir / "cluster.json").exists()
        assert not (mooncake.state_dir / "cluster-starting.json").exists()
    finally:
        mooncake("down", "--timeout", "5")
