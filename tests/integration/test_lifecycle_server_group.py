"""An EmbeddedServer's binary may be a wrapper script: what the wrapper starts is in the process
group of the pid the server was started as (a session of its own), and it goes with the server;
a wrapper that runs the server without exec is refused as soon as the server answers."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from helpers import wait_until

from mooncake_store.embedded import EmbeddedServer, find_server_binary
from mooncake_store.errors import ServerError
from mooncake_store.watchdog import start_time


def _wrapper(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "wrapped-server"
    script.write_text(f"#!/bin/sh\nREAL={str(find_server_binary())!r}\n{body}\n")
    script.chmod(0o755)
    return script


def _recorded(path: Path) -> tuple[int, int | None]:
    """A pid the wrapper wrote, with its start time (None once it is gone)."""
    pid = int(path.read_text().split()[0])
    return pid, start_time(pid)


def _gone(pid: int, started: int | None, timeout_s: float = 10.0) -> bool:
    """Whether the process that had ``pid`` at ``started`` is gone, within ``timeout_s``."""
    return wait_until(lambda: started is None or start_time(pid) != started, timeout_s)


def _kill_if_left(pid: int, started: int | None) -> None:
    if started is not None and start_time(pid) == started:
        os.kill(pid, signal.SIGKILL)


def test_stop_takes_what_the_wrapper_started_beside_the_server(tmp_path: Path) -> None:
    """The wrapper starts a helper, then execs the server: the helper is the server's child, in its
    process group. Only the server's pid was signalled, and the helper ran on."""
    helper_file = tmp_path / "helper.pid"
    binary = _wrapper(tmp_path, f'sleep 600 &\necho $! > {helper_file}\nexec "$REAL" "$@"')
    server = EmbeddedServer(binary=binary, startup_timeout_s=30).start()
    helper, helper_start = _recorded(helper_file)
    try:
        assert helper_start is not None
        server.stop()
        assert _gone(helper, helper_start), f"the wrapper's helper (pid {helper}) outlived the server's stop"
    finally:
        server.stop()
        _kill_if_left(helper, helper_start)


def test_a_start_that_times_out_takes_the_wrappers_children_with_it(tmp_path: Path) -> None:
    silent_file = tmp_path / "silent.pid"
    binary = _wrapper(tmp_path, f"sleep 600 &\necho $! > {silent_file}\nwait")
    server = EmbeddedServer(binary=binary, startup_timeout_s=1.0)
    with pytest.raises(ServerError, match="did not answer on"):
        server.start()
    silent, silent_start = _recorded(silent_file)
    try:
        assert _gone(silent, silent_start), f"the wrapper's child (pid {silent}) outlived the failed start"
    finally:
        _kill_if_left(silent, silent_start)


def test_a_wrapper_that_does_not_exec_the_server_is_refused_naming_both_pids(tmp_path: Path) -> None:
    """The server answered as a pid other than the one started, so the start waited out its whole
    timeout ("did not answer"), then stopped the wrapper alone: the real server ran on."""
    server_file = tmp_path / "server.pid"
    binary = _wrapper(tmp_path, f'"$REAL" "$@" &\necho $! > {server_file}\nwait')
    server = EmbeddedServer(binary=binary, startup_timeout_s=20)
    real, real_start = 0, None
    try:
        with pytest.raises(ServerError) as caught:
            server.start()
        real, real_start = _recorded(server_file)
        message = str(caught.value)
        assert "did not exec the server" in message, message
        assert f"started pid {server.pid}, server answers as pid {real}" in message, message
        assert re.search(r"use exec\b", message), message
        assert not server.running
        assert _gone(real, real_start), f"the real server (pid {real}) outlived the refused start"
        assert server.temp_dir is None
    finally:
        server.stop()
        if not real and server_file.exists():
            real, real_start = _recorded(server_file)
        _kill_if_left(real, real_start)
