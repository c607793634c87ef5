"""An EmbeddedServer made with exit_with_parent is guarded from the moment its process starts, not
from the moment it answers: a launcher killed with SIGKILL while it waits for the server to answer
must not leave the server, or its temp dir, behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import wait_until

from mooncake_store.embedded import EmbeddedServer, find_server_binary
from mooncake_store.errors import ServerError
from mooncake_store.watchdog import start_time

REPO = Path(__file__).resolve().parents[2]


def _slow_server(tmp_path: Path) -> tuple[Path, Path]:
    """A server binary that says where it is (pid, argv), then takes its time before it becomes
    the real server (exec: same pid)."""
    said = tmp_path / "said.json"
    script = tmp_path / "slow-server"
    script.write_text(
        f"#!{sys.executable} -S\n"
        + textwrap.dedent(f"""\
            import json, os, sys, time
            with open({str(said)!r} + ".tmp", "w") as f:
                json.dump({{"pid": os.getpid(), "argv": sys.argv[1:]}}, f)
            os.rename({str(said)!r} + ".tmp", {str(said)!r})
            time.sleep(600)
            real = {str(find_server_binary())!r}
            os.execv(real, [real, *sys.argv[1:]])
            """)
    )
    script.chmod(0o755)
    return script, said


def test_a_launcher_killed_while_the_server_starts_takes_the_server_and_its_dir_with_it(tmp_path: Path) -> None:
    binary, said = _slow_server(tmp_path)
    launcher_code = textwrap.dedent(f"""\
        from mooncake_store.embedded import EmbeddedServer
        EmbeddedServer(binary={str(binary)!r}, exit_with_parent=True, startup_timeout_s=900).start()
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], env=env, stdin=subprocess.DEVNULL)
    server_pid, server_start, temp_dir = 0, None, None
    helpers: dict[int, int | None] = {}
    try:
        assert wait_until(lambda: said.exists() or launcher.poll() is not None, 60), "the server never started"
        assert launcher.poll() is None, "the launcher ended before it could be killed while it waited"
        info = json.loads(said.read_text())
        server_pid = int(info["pid"])
        server_start = start_time(server_pid)
        temp_dir = Path(info["argv"][info["argv"].index("--dir") + 1])
        assert server_start is not None and temp_dir.is_dir()
        # The watchdog comes right after the server's Popen: give it a moment to show (with none,
        # the kill below still comes, and the server is seen to outlive it). The launcher is then
        # in its wait for an answer, which cannot come for 600 s.
        wait_until(lambda: len(_children(launcher.pid)) > 1, 5)
        helpers = {pid: start_time(pid) for pid in _children(launcher.pid) - {server_pid}}
        assert launcher.poll() is None
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        assert wait_until(lambda: start_time(server_pid) != server_start, 30), (
            f"the server (pid {server_pid}) outlived its launcher, killed while it waited for an answer"
        )
        assert wait_until(lambda: not temp_dir.exists(), 30), f"{temp_dir} outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
        if server_pid and server_start is not None and start_time(server_pid) == server_start:
            os.kill(server_pid, signal.SIGKILL)
        for pid, started in helpers.items():  # a watchdog that failed to end on its own
            if started is not None and start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _children(pid: int) -> set[int]:
    """The pids of ``pid``'s children (any thread's), from /proc."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def _watchdogs_of_this_process() -> list[int]:
    found = []
    for pid in _children(os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if start_time(pid) is not None and any(a.endswith(b"watchdog.py") for a in argv):
            found.append(pid)
    return found


def test_an_attempt_on_a_port_found_taken_leaves_no_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each attempt at a start has its own watchdog from its Popen on; the one of an attempt whose
    port another process took is stopped before the next attempt, so one server has one watchdog."""
    import mooncake_store.embedded as embedded

    before = set(_watchdogs_of_this_process())
    with EmbeddedServer() as occupant:
        ports = iter([occupant.port])
        real_free_port = embedded._free_port
        monkeypatch.setattr(embedded, "_free_port", lambda host: next(ports, None) or real_free_port(host))
        server = EmbeddedServer(exit_with_parent=True).start()
        try:
            assert server.port != occupant.port  # the first attempt found its port taken
            assert server._watchdog is not None
            assert set(_watchdogs_of_this_process()) - before == {server._watchdog.pid}
        finally:
            server.stop()
    assert set(_watchdogs_of_this_process()) - before == set()


def test_a_server_that_fails_to_start_leaves_no_watchdog(tmp_path: Path) -> None:
    fake = tmp_path / "fake-server"
    fake.write_text("#!/bin/sh\nsleep 0.5\necho 'fatal: bad config' >&2\nexit 3\n")
    fake.chmod(0o755)
    before = set(_watchdogs_of_this_process())
    srv = EmbeddedServer(binary=fake, startup_timeout_s=30.0, exit_with_parent=True)
    with pytest.raises(ServerError, match="bad config"):
        srv.start()
    assert set(_watchdogs_of_this_process()) - before == set()
    assert srv.temp_dir is None
