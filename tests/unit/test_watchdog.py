"""mooncake_store/watchdog.py against real processes: it stops its child once the launcher is gone,
and never a process whose pid merely matches (a different start time)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from mooncake_store import watchdog
from mooncake_store.embedded import watchdog_command

WATCHDOG = Path(watchdog.__file__)


def run_watchdog(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The watchdog started as a LocalCluster starts it (embedded.watchdog_command)."""
    return subprocess.run([*watchdog_command(), *args], capture_output=True, timeout=30)


def test_the_watchdog_starts_where_the_package_is_not_preloaded() -> None:
    """Run by path, the script's folder goes first on sys.path, and mooncake_store/types.py took
    the standard library's place: in an installed (not editable) package, whose .pth had not
    imported the real module first, the watchdog died at its first import and a LocalCluster's
    server outlived a launcher killed with SIGKILL. -S leaves site (and the editable .pth) out, as
    such an install has nothing to preload; watchdog_command() must still start it."""
    python, *rest = watchdog_command()
    got = subprocess.run([python, "-S", *rest, "--help"], capture_output=True, timeout=30, cwd="/")
    assert got.returncode == 0, got.stderr.decode(errors="replace")[-400:]
    assert b"--child-start" in got.stdout


def test_a_gone_parent_means_the_child_is_stopped_and_its_dir_removed(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "60"])
    private = tmp_path / "private"
    private.mkdir()
    try:
        started = watchdog.start_time(child.pid)
        assert started is not None
        # --parent names a process that is not the watchdog's parent (this test is): as if re-parented.
        got = run_watchdog("--parent", "1", "--child", str(child.pid), "--child-start", str(started),
                           "--remove-dir", str(private))  # fmt: skip
        assert got.returncode == 0, got.stderr
        assert child.wait(timeout=10) == -15  # SIGTERM
        assert not private.exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def test_a_pid_with_another_start_time_is_left_alone(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "60"])
    private = tmp_path / "private"
    private.mkdir()
    try:
        started = watchdog.start_time(child.pid)
        assert started is not None
        got = run_watchdog("--parent", "1", "--child", str(child.pid), "--child-start", str(started + 1),
                           "--remove-dir", str(private))  # fmt: skip
        assert got.returncode == 0, got.stderr
        assert child.poll() is None  # not the process it was told to guard: untouched
        # The guarded server is gone (its pid names another process) and so is the launcher: the
        # server's private dir has no one else left to remove it.
        assert not private.exists()
    finally:
        child.kill()
        child.wait(timeout=10)


def test_start_time_of_a_zombie_or_a_missing_pid_is_none() -> None:
    child = subprocess.Popen(["true"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: a zombie
    assert watchdog.start_time(child.pid) is None
    child.wait(timeout=10)
    assert watchdog.start_time(child.pid) is None
    assert watchdog.start_time(os.getpid()) is not None


def test_a_gone_parent_means_the_childs_whole_process_group_is_stopped(tmp_path: Path) -> None:
    """The child leads a process group of its own (as the embedded server does): a wrapper script
    that started the server as its child, not by exec. Only the wrapper's pid was signalled, and
    what it had started ran on."""
    inner_file = tmp_path / "inner.pid"
    child = subprocess.Popen(["sh", "-c", f"sleep 600 & echo $! > {inner_file}; wait"], start_new_session=True)
    inner, inner_start = 0, None
    try:
        deadline = time.monotonic() + 10
        while not (inner_file.exists() and inner_file.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.02)
        inner = int(inner_file.read_text())
        inner_start = watchdog.start_time(inner)
        started = watchdog.start_time(child.pid)
        assert started is not None and inner_start is not None
        got = run_watchdog("--parent", "1", "--child", str(child.pid), "--child-start", str(started))
        assert got.returncode == 0, got.stderr
        assert child.wait(timeout=10) != 0
        deadline = time.monotonic() + 10
        while watchdog.start_time(inner) == inner_start and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watchdog.start_time(inner) != inner_start, f"the child's own child (pid {inner}) outlived it"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        if inner_start is not None and watchdog.start_time(inner) == inner_start:
            os.kill(inner, signal.SIGKILL)


def test_a_child_that_leads_no_group_is_signalled_alone(tmp_path: Path) -> None:
    """A child in this process's group (no session of its own): the watchdog signals its pid, never
    the group it shares with others (this test among them)."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        started = watchdog.start_time(child.pid)
        assert started is not None and os.getpgid(child.pid) != child.pid
        got = run_watchdog("--parent", "1", "--child", str(child.pid), "--child-start", str(started))
        assert got.returncode == 0, got.stderr
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
