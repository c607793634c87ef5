"""`mooncake down`'s report counts the processes of the cluster it stopped, however they stopped."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable

import pytest
from helpers import mooncake_bin

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


@pytest.mark.parametrize("damage", ["{not json", "[" * 100_000 + "]" * 100_000])
def test_doctor_with_a_damaged_state_file_exits_as_every_command_does(mooncake: Mooncake, damage: str) -> None:
    """A damaged state file is exit 1 for every command; doctor gave 4 ("cannot connect"), which a
    script reads as "retry later" for a file that only a person can fix. Nested too deep for json
    to read, it was "internal error: RecursionError" for every command."""
    mooncake.state_dir.mkdir(parents=True, exist_ok=True)
    (mooncake.state_dir / "cluster.json").write_text(damage)
    stat = mooncake("stat")
    doctor = mooncake("doctor")
    assert stat.returncode == 1, stat.stderr
    assert doctor.returncode == stat.returncode, (doctor.stdout, doctor.stderr)
    assert b"damaged" in doctor.stdout, doctor.stdout
    assert b"damaged" in stat.stderr and b"internal error" not in stat.stderr, stat.stderr


def test_mooncake_up_with_a_listen_host_that_is_not_utf8_exits_2(mooncake: Mooncake) -> None:
    """A stray byte in MOONCAKE_AGENT_LISTEN reached the socket layer: "internal error", exit 1."""
    env = {k.encode(): v.encode() for k, v in mooncake.env.items()}
    env[b"MOONCAKE_AGENT_LISTEN"] = b"\xff:0"
    try:
        result = subprocess.run(
            [mooncake_bin(), "up", "-n", "1", "--host-mem", HOST_MEM, "--detach"],
            env=env,
            capture_output=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr.decode(errors="replace")
        assert b"internal error" not in result.stderr and b"MOONCAKE_AGENT_LISTEN" in result.stderr, result.stderr
    finally:
        mooncake("down", "--timeout", "5")
