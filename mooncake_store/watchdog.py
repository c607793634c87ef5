"""Stops a process once the process that started it is gone: the private Redis-compatible server
of a LocalCluster (or any EmbeddedServer made with ``exit_with_parent``) must not outlive a
launcher killed with SIGKILL, which runs no cleanup. The agents watch their launcher themselves
(``--exit-with-parent``); a Valkey server cannot, so this small process watches for it.

    python mooncake_store/watchdog.py --parent PID --child PID --child-start TICKS [--remove-dir DIR]

Run by path, not with ``-m``: importing the package would load numpy and redis into a process
that only polls. It checks once every POLL_S:

- this process's parent is no longer ``--parent`` (the launcher died and we were re-parented):
  SIGTERM the child if it still runs, SIGKILL it after STOP_GRACE_S, remove ``--remove-dir`` (the
  server's private temp dir), exit. The child was started in a session of its own, so it leads a
  process group whose id is its pid: while it does, the signals go to that whole group, and what a
  wrapper script started beside the server (or ran it as) goes with it; else to the child alone;
- the child has ended (or its pid now names another process: ``--child-start`` is its start time,
  field 22 of /proc/PID/stat): with no ``--remove-dir``, nothing left to guard, exit. With one, the
  watch goes on for the launcher alone: a server that died (a crash, the OOM killer) before its
  launcher was killed outright left its temp dir behind for good, since only the launcher's own
  stop removed it once the watchdog had gone.

The project's long-running processes (an agent, the embedded server's wrapper) import two helpers
from here: ``watch_parent`` (``--exit-with-parent``) and ``stop_on_signals``.

SIGINT is ignored (a Ctrl-C in the launcher's terminal is the launcher's to handle); SIGTERM, which
the launcher sends when it stops the server itself, ends the watch.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

POLL_S = 1.0
STOP_GRACE_S = 5.0
#: How often a process started with --exit-with-parent (an agent, the embedded server's wrapper)
#: checks that its launcher is still there.
PARENT_CHECK_S = 1.0


def watch_parent(pid: int, stop: threading.Event, *, what: str) -> None:
    """Set ``stop`` once ``pid`` is no longer this process's parent (it died: this process was
    re-parented), so that a process whose launcher was killed (SIGKILL runs no cleanup) does not
    live on: an agent holding its arena, a foreground `mooncake up`'s server. Polled:
    PR_SET_PDEATHSIG fires when the forking *thread* ends, which would stop processes a launcher
    started from a short-lived thread. ``what`` names this process in the warning."""

    def run() -> None:
        while not stop.wait(PARENT_CHECK_S):
            if os.getppid() != pid:
                logging.getLogger("mooncake").warning("%s: launcher process %d is gone; stopping", what, pid)
                stop.set()

    threading.Thread(target=run, name="mc-parent-watch", daemon=True).start()


#: The signals that stop a long-running process of the project (an agent, the embedded server's
#: wrapper): `kill`, Ctrl-C, a closed terminal.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_on_signals(stop: threading.Event, signums: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Set ``stop`` when one of ``signums`` arrives; from the main thread only (signal handlers are
    set there). Not from the handler: Python runs a handler on the main thread between two of its
    bytecodes, and ``Event.set`` takes the event's lock, which is no re-entrant one; a signal that
    landed while the main thread held it (inside the handler of the signal before, or in its own
    ``stop.wait``) deadlocked the process for good. Two SIGTERMs back to back (LocalCluster's stop
    sends one after its terminate) did so about once in fifteen stops, and the agent was SIGKILLed
    10 s later, its node left to be reaped. The handler does nothing; the signal's byte on the
    wakeup fd, written by the interpreter's C-level handler, wakes a thread that sets ``stop``."""
    read_end, write_end = socket.socketpair()
    write_end.setblocking(False)  # set_wakeup_fd requires it: a full buffer must not block a signal
    signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)
    for signum in signums:
        signal.signal(signum, lambda _signum, _frame: None)
    # Once the process exits they are ignored: the interpreter's shutdown puts the default action
    # back, and the tail of a burst then killed a process that had stopped cleanly (status -2).
    atexit.register(lambda: [signal.signal(signum, signal.SIG_IGN) for signum in signums])

    def relay() -> None:
        # Both ends live as long as the process: the wakeup fd is written for every later signal.
        # Each byte is a signal's number; another signal Python handles (none here) is no stop.
        keep = (read_end, write_end)
        while arrived := keep[0].recv(64):
            if any(signum in signums for signum in arrived):
                stop.set()

    threading.Thread(target=relay, name="mc-signals", daemon=True).start()


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state first), or None when the
    process is gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks, or None when it is gone or a zombie."""
    fields = stat_fields(pid)
    if fields is None or fields[0] == "Z":  # Z: exited, waiting for its parent to reap it
        return None
    return int(fields[19])  # field 22 of the whole line: the comm and pid come before ")"


def group_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run (zombies are done), from /proc; [] where
    there is no /proc to read."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(int(entry.name))
        if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def stop_child(child: int, child_start: int) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE_S; only while ``child`` is still the process we watch
    (its start time, so a reused pid is never signalled). While the child leads its process group
    (group id == its pid) the whole group is signalled, until none of it runs: a wrapper script's
    own children went on running when only its pid was, and a member that ignores SIGTERM once
    its leader had exited. A group's id names no other process while any member of it runs."""
    if start_time(child) != child_start:
        return
    try:
        leads = os.getpgid(child) == child
    except ProcessLookupError:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if leads and group_members(child):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, sig)
        elif not leads and start_time(child) == child_start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, sig)
        else:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and (group_members(child) if leads else start_time(child) == child_start):
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="watchdog.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parent", type=int, required=True, help="the launcher's pid")
    parser.add_argument("--child", type=int, required=True, help="the pid of the process to stop")
    parser.add_argument("--child-start", type=int, required=True, help="the child's start time (clock ticks)")
    parser.add_argument("--remove-dir", default=None, help="a private directory to remove after the child")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        child_gone = start_time(args.child) != args.child_start
        if os.getppid() != args.parent:
            if not child_gone:
                stop_child(args.child, args.child_start)
            if args.remove_dir:
                shutil.rmtree(args.remove_dir, ignore_errors=True)
            return 0
        if child_gone and not args.remove_dir:
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
