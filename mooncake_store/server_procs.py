"""Stopping the processes an EmbeddedServer starts: the server leads a process group of its own
(it starts in a session of its own), which is signalled whole, so that what a wrapper script
started beside it goes too, and only while it is the server's: its leader not reaped, here or
by other code, and its id still the leader's pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from mooncake_store.watchdog import group_members, stat_fields


def exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether a process we started has ended, without reaping it: while it is a zombie its pid,
    and so the id of the process group it leads, cannot be given to another process."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere (os.wait in the caller's code)
        proc.poll()
        return True


def signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Signal the process group ``proc`` leads (it was started in a session of its own, so a
    wrapper script's children are in it too), only while that group is ours: its leader is not
    reaped yet and the group's id is still its pid; else ``proc`` alone."""
    # Reaped, here or by other code (os.wait, SIGCHLD ignored), or no child of this process (a
    # forked copy of its Popen): exited() then sets returncode. The pid, and the group id, may be
    # another's by now.
    exited(proc)
    if proc.returncode is not None:
        return
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signum)
            return
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)


def started_by(pid: int, leader: int) -> bool:
    """Whether ``pid`` is in the process group ``leader`` leads, or descends from ``leader``."""
    try:
        if os.getpgid(pid) == leader:
            return True
    except OSError:
        return False
    for _ in range(64):  # up the parents, a bounded walk
        fields = stat_fields(pid)
        if fields is None or pid <= 1:
            return False
        pid = int(fields[1])  # the parent's pid
        if pid == leader:
            return True
    return False


def stop_process(proc: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    """SIGTERM the process group of one process we started, SIGKILL after ``timeout_s`` what of it
    still runs; then reap it. A wrapper script that ran the server without exec was the only one
    signalled before, and the server it started ran on. The leader is reaped only once its group
    is done, so its group id names no one else's processes meanwhile."""

    def done() -> bool:
        return exited(proc) and not group_members(proc.pid)

    for signum in (signal.SIGTERM, signal.SIGKILL):
        if proc.returncode is not None or done():
            break
        signal_group(proc, signum)
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            time.sleep(0.02)
    proc.wait(timeout=timeout_s)
