"""Processes the CLI starts and later stops by PID, possibly from another shell.

A PID alone is not an identity: after a reboot or a long time the number may belong to someone
else's process. Each PID is therefore recorded with its start time from ``/proc/PID/stat``, and a
process is signalled only while both still match. Nothing is ever looked up or killed by name.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from mooncake_store.tiers.host import segment_paths


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcRef:
    pid: int
    start_ticks: int  # field 22 of /proc/PID/stat; 0 where /proc is not available

    def to_dict(self) -> dict[str, int]:
        return {"pid": self.pid, "start_ticks": self.start_ticks}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ProcRef:
        return cls(pid=int(str(data["pid"])), start_ticks=int(str(data.get("start_ticks", 0))))


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ")".
    return raw[raw.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else 0


def ref_of(pid: int) -> ProcRef:
    return ProcRef(pid=pid, start_ticks=start_ticks(pid))


def alive(ref: ProcRef) -> bool:
    """True while the recorded process runs (a zombie counts as gone: it holds no resources)."""
    if ref.pid <= 0:
        return False
    fields = _stat_fields(ref.pid)
    if fields is None:
        if Path("/proc/self/stat").exists():
            return False
        try:  # no procfs (not Linux): fall back to the PID alone
            os.kill(ref.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] == "Z":
        return False
    # With procfs a recorded start of 0 means the process was already gone when it was recorded:
    # whatever runs under that PID now is another process, never to be signalled.
    return ref.start_ticks != 0 and int(fields[19]) == ref.start_ticks


def _signal(ref: ProcRef, signum: int) -> None:
    if alive(ref):
        with contextlib.suppress(ProcessLookupError):
            os.kill(ref.pid, signum)


def _reap(pid: int) -> None:
    # Our own children must be waited for, or they stay zombies; others' children raise ChildProcessError.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def wait_gone(refs: list[ProcRef], timeout_s: float) -> list[ProcRef]:
    """Wait until every process is gone or ``timeout_s`` passes; the ones still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        for ref in refs:
            _reap(ref.pid)
        left = [r for r in refs if alive(r)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def terminate(refs: list[ProcRef], timeout_s: float) -> list[ProcRef]:
    """SIGTERM each, wait up to ``timeout_s``, then SIGKILL the rest; returns the ones killed."""
    for ref in refs:
        _signal(ref, signal.SIGTERM)
    stubborn = wait_gone(refs, timeout_s)
    for ref in stubborn:
        _signal(ref, signal.SIGKILL)
    wait_gone(stubborn, 5.0)
    return stubborn


def remove_segments(names: list[str]) -> list[str]:
    """Unlink the named shared-memory segments that still exist; the names removed."""
    removed = []
    for name in names:
        # Names come from our own state file, but never let one escape /dev/shm.
        if not name or "/" in name or name in (".", ".."):
            continue
        # A pattern (segment_pattern) stands for the segment of an agent that died before it said
        # its name: its pid is in the pattern, and the agent is stopped by now.
        for path in segment_paths(name):
            if path.exists():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path.name)
    return removed


def spawn_detached(cmd: list[str], *, stdout: Path, stderr: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a session of its own (no terminal signals, survives this shell)."""
    with stdout.open("wb") as out, stderr.open("ab") as err:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True, close_fds=True
        )


def wait_for_line(proc: subprocess.Popen[bytes], path: Path, prefix: str, timeout_s: float) -> str | None:
    """The first line of ``path`` that starts with ``prefix``, once the process has written it;
    None when the process exits or the time runs out first."""
    found = wait_for_match(proc, path, re.compile("^" + re.escape(prefix) + ".*$", re.MULTILINE), timeout_s)
    return found.group(0) if found else None


def wait_for_match(
    proc: subprocess.Popen[bytes], path: Path, pattern: re.Pattern[str], timeout_s: float
) -> re.Match[str] | None:
    """The first match of ``pattern`` in ``path`` once the process has written it (other lines,
    such as warnings, may come first); None when the process exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            found = pattern.search(path.read_text(errors="replace"))
            if found:
                return found
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def own_error(path: Path) -> str:
    """The last line in a process's log that it wrote itself as an error ("error: ..."), without
    that prefix; "" if none."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    said = [line for line in text.splitlines() if line.startswith("error: ")]
    return said[-1].removeprefix("error: ").strip() if said else ""


def log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return " | ".join(text.splitlines()[-lines:])
