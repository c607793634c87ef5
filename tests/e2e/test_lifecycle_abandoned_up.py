"""A detached `mooncake up` killed outright (SIGKILL) half way through its start: what it had
started is named in cluster-starting.json, and `mooncake down`, or the next `up`, stops it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from mooncake_cli.procs import ProcRef, alive, ref_of

from .conftest import HOST_MEM, Mooncake

STARTING = "cluster-starting.json"


def _children(pid: int) -> list[ProcRef]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [ref_of(int(c)) for c in (task / "children").read_text().split()]
    return found


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):  # not written yet (it is replaced whole, never half written)
        return None


def _procs_of(record: dict[str, Any]) -> list[ProcRef]:
    return [ProcRef.from_dict(s) for s in record["servers"]] + [ProcRef.from_dict(a) for a in record["agents"]]


@pytest.fixture
def left_behind(mooncake: Mooncake) -> Iterator[list[ProcRef]]:
    """Processes a test's killed `up` started; whatever of them still runs at the end (the test
    failed) is stopped by its pid and start time, after a `down`."""
    refs: list[ProcRef] = []
    yield refs
    mooncake("down", "--timeout", "5")
    for ref in refs:
        if alive(ref):
            os.kill(ref.pid, signal.SIGKILL)


def _kill_up_once_its_server_is_recorded(mooncake: Mooncake, left_behind: list[ProcRef]) -> dict[str, Any]:
    """Start `up --detach`, SIGKILL it once its starting record names the embedded server (wrapper
    and server); the record as that `up` left it."""
    path = mooncake.state_dir / STARTING
    up = mooncake.popen("up", "--detach", "--agents", "2", "--host-mem", HOST_MEM)
    try:
        deadline = time.monotonic() + 120
        record = None
        while up.poll() is None and time.monotonic() < deadline:
            record = _read_record(path)
            if record is not None and len(record["servers"]) >= 2:
                break
            time.sleep(0.005)
        assert up.poll() is None, "`up` ended with no starting record that named its server"
        assert record is not None and len(record["servers"]) >= 2, f"no starting record naming the server: {record}"
        os.kill(up.pid, signal.SIGSTOP)  # its children, recorded or not, are stopped at the end should the test fail
        left_behind += _children(up.pid)
        up.kill()
        up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate(timeout=30)
    record = _read_record(path)
    assert record is not None, "the killed `up` left no starting record"
    assert record["up"]["pid"] == up.pid
    left_behind += _procs_of(record)
    assert any(alive(p) for p in _procs_of(record)), "nothing the killed `up` started runs: nothing to show"
    return record


def _assert_all_gone(record: dict[str, Any]) -> None:
    refs = _procs_of(record)
    assert wait_until(lambda: not any(alive(r) for r in refs), 30), [r for r in refs if alive(r)]
    assert not record["server_dir"] or not Path(record["server_dir"]).exists()
    shm = Path("/dev/shm")
    for name in record["shm_segments"]:
        assert not list(shm.glob(name)), f"shared-memory segment {name} outlived the stop"


def test_down_stops_what_an_up_killed_while_starting_had_started(
    mooncake: Mooncake, left_behind: list[ProcRef]
) -> None:
    """`up` recorded its cluster only once all of it had started: killed half way, it left its
    server (and any agent it had started) running with no record, and `down` said "nothing to stop"."""
    record = _kill_up_once_its_server_is_recorded(mooncake, left_behind)
    # It names processes to kill: written as cluster.json is, readable and writable by its owner alone.
    assert (mooncake.state_dir / STARTING).stat().st_mode & 0o777 == 0o600
    down = mooncake("down", "--timeout", "5", timeout=120)
    assert down.returncode == 0, down.stderr.decode(errors="replace")
    assert "nothing to stop" not in down.stderr.decode(), down.stderr.decode()
    _assert_all_gone(record)
    assert not (mooncake.state_dir / STARTING).exists()
    assert not (mooncake.state_dir / "cluster.json").exists()
    again = mooncake("down", "--timeout", "5")
    assert again.returncode == 0 and "nothing to stop" in again.stderr.decode(), again.stderr.decode()


def test_the_next_up_stops_what_a_killed_up_had_started_then_starts_cleanly(
    mooncake: Mooncake, left_behind: list[ProcRef]
) -> None:
    record = _kill_up_once_its_server_is_recorded(mooncake, left_behind)
    up = mooncake("up", "--detach", "--agents", "1", "--host-mem", HOST_MEM, "--json", timeout=180)
    assert up.returncode == 0, up.stderr.decode(errors="replace")
    _assert_all_gone(record)
    assert not (mooncake.state_dir / STARTING).exists()
    state = json.loads(up.stdout)
    started = _procs_of(state)
    left_behind += started
    assert started and all(alive(p) for p in started)
    down = mooncake("down", "--timeout", "5", timeout=120)
    assert down.returncode == 0, down.stderr.decode(errors="replace")
    _assert_all_gone(state)
    assert not (mooncake.state_dir / "cluster.json").exists()
    assert not (mooncake.state_dir / STARTING).exists()
