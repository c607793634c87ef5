"""An EmbeddedServer's stop signals the process group its server leads, and only while that group
is its own; the watchdog of one whose launcher was killed stops that whole group.

- A forked child that exits normally runs the stop of its copy (a `finally`, the atexit stop): it
  signalled its parent's server group (Popen.returncode is None in a copy that is no parent) and
  removed the parent's temp dir. Only the process that started a server stops it.
- A server reaped by the caller's own code (os.wait, SIGCHLD ignored) left returncode None while
  its pid was free for another group's leader, which stop() would then have signalled.
- The watchdog sent SIGKILL only while the group's leader ran: a member that ignored SIGTERM (a
  helper a wrapper script started beside the server) outlived the launcher once the leader was gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mooncake_store import server_procs
from mooncake_store.embedded import find_server_binary

FORKING = textwrap.dedent(
    """
    import os, sys, time
    from mooncake_store.embedded import EmbeddedServer
    server = EmbeddedServer().start()
    try:
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit of a forked child: atexit handlers run
        os.waitpid(pid, 0)
        time.sleep(0.5)
        c = server.client(socket_timeout=2)
        try:
            ok = c.ping()
        except Exception as exc:
            ok = repr(exc)
        finally:
            c.close()
        print("RUNNING", server.running, "PING", ok, "DIR", server.temp_dir.is_dir(), flush=True)
    finally:
        server.stop()
    """
)


def test_a_forked_child_that_exits_leaves_its_parents_server_running() -> None:
    res = subprocess.run([sys.executable, "-c", FORKING], capture_output=True, text=True, timeout=60)
    assert "RUNNING True PING True DIR True" in res.stdout, (res.stdout, res.stderr[-2000:])


def test_stopping_a_server_reaped_elsewhere_signals_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pid of a server the caller's code reaped behind Popen's back is free: once the kernel
    gives it to a process that leads a group (simulated here), a killpg would reach that group."""
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    os.kill(proc.pid, signal.SIGKILL)
    os.waitpid(proc.pid, 0)
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(server_procs.os, "getpgid", lambda pid: pid)
    monkeypatch.setattr(server_procs.os, "killpg", lambda pgid, sig: signalled.append((pgid, sig)))
    server_procs.stop_process(proc, timeout_s=0.5)
    assert signalled == [], f"signalled a group that is not ours: {signalled}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_watchdog_stops_a_group_member_that_outlives_sigterm(tmp_path: Path) -> None:
    helper_file = tmp_path / "helper.pid"
    wrapper = tmp_path / "server.sh"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"sh -c 'trap \"\" TERM; echo $$ > {helper_file}; exec sleep 300' &\n"
        f'exec {find_server_binary()} "$@"\n'
    )
    wrapper.chmod(0o755)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import time
                from mooncake_store.embedded import EmbeddedServer
                s = EmbeddedServer(binary={str(wrapper)!r}, exit_with_parent=True).start()
                print("READY", s.pid, flush=True)
                time.sleep(300)
            """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    helper = 0
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        assert line.startswith("READY"), line
        server_pid = int(line.split()[1])
        for _ in range(100):  # the wrapper wrote it before it exec'd the server
            if helper_file.read_text().strip() if helper_file.exists() else "":
                break
            time.sleep(0.05)
        helper = int(helper_file.read_text())
        assert _alive(helper) and _alive(server_pid)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20  # a poll (1 s), then two grace periods (5 s each)
        while time.monotonic() < deadline and (_alive(server_pid) or _alive(helper)):
            time.sleep(0.2)
        assert not _alive(server_pid)
        assert not _alive(helper), "the wrapper's helper outlived the watchdog's stop"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if helper and _alive(helper):
            os.kill(helper, signal.SIGKILL)
