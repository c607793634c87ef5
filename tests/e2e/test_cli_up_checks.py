"""`mooncake up`: what it checks before it starts anything, what `--json` prints in the
foreground, and what `down` removes when the embedded server's wrapper was killed outright."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from .conftest import HOST_MEM, Mooncake, assert_one_line_error, error_lines
from .test_cli_lifecycle import socket_on_a_free_port


def _no_processes_started(mooncake: Mooncake) -> None:
    logs = mooncake.state_dir / "logs"
    started = sorted(p.name for p in logs.glob("*.log")) if logs.exists() else []
    assert started == [], f"processes were started before the check failed: {started}"
    assert not (mooncake.state_dir / "cluster.json").exists()


def test_up_with_a_server_it_cannot_reach_is_exit_4_before_any_agent_starts(mooncake: Mooncake) -> None:
    """Each agent found out on its own, exited, and `up` reported the agents' exits (exit 1)."""
    with socket_on_a_free_port() as port:  # bound, not listening: connections are refused
        url = f"redis://127.0.0.1:{port}/0"
        result = mooncake("up", "--detach", "--agents", "2", "--host-mem", "16MiB", "--redis-url", url)
    assert_one_line_error(result, 4, f"cannot reach Redis at {url}", "--redis-url")
    _no_processes_started(mooncake)


def test_up_refuses_a_port_for_a_server_it_would_not_start(mooncake: Mooncake) -> None:
    """`--port` with `--redis-url` was ignored without a word: the port names no server then."""
    result = mooncake("up", "--detach", "--redis-url", "redis://127.0.0.1:1/0", "--port", "5555")
    assert_one_line_error(result, 2, "--port 5555", "redis://127.0.0.1:1/0", "leave out one or the other")
    _no_processes_started(mooncake)


def test_up_refuses_a_wildcard_listen_without_advertise_before_starting_anything(mooncake: Mooncake) -> None:
    """The agent refused it (exit 1, after the embedded server and the agents had started)."""
    result = mooncake(
        "up", "--detach", "--agents", "1", "--host-mem", "16MiB", env={"MOONCAKE_AGENT_LISTEN": "0.0.0.0:0"}
    )
    assert_one_line_error(result, 2, "binds every interface", "agent.advertise")
    _no_processes_started(mooncake)


def test_up_refuses_one_fixed_listen_port_for_several_agents(mooncake: Mooncake) -> None:
    """Every agent was given the same port: the second exited with "address already in use", as
    if another program held it, after the server and the first agent had started."""
    with socket_on_a_free_port() as port:
        pass  # free now; the check comes before anything would bind it
    listen = f"127.0.0.1:{port}"
    result = mooncake("up", "--detach", "--agents", "2", "--host-mem", "16MiB", env={"MOONCAKE_AGENT_LISTEN": listen})
    assert_one_line_error(result, 2, f"agent.listen={listen!r}", "port 0", "--agents 1")
    _no_processes_started(mooncake)


def _read_json_document(proc: subprocess.Popen[bytes], *, timeout_s: float) -> bytes:
    """What ``proc`` prints on stdout until its JSON document has ended (json.dumps with an indent
    closes it with '}' alone on its line), it exits, or ``timeout_s`` passes. Read from the raw
    descriptor, so that communicate() later reads the rest."""
    assert proc.stdout is not None
    fd, got = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while not got.endswith(b"\n}\n") and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            got += chunk
    return got


def test_foreground_up_with_json_prints_one_json_document(mooncake: Mooncake, pid_alive: Callable[[int], bool]) -> None:
    """The live tables followed the JSON on stdout, which then did not parse."""
    proc = mooncake.popen("up", "--agents", "1", "--host-mem", HOST_MEM, "--json")
    try:
        # The document itself, not the state file (written before it is printed): on a loaded
        # machine a fixed sleep after the file could end before the live view began.
        printed = _read_json_document(proc, timeout_s=30)
        assert printed.endswith(b"\n}\n"), proc.stderr.read() if proc.poll() is not None and proc.stderr else printed
        # A live view would draw its first frame right after the document (into a pipe, rich shows
        # it at the stop); this leaves it that and a second one.
        time.sleep(2.5)
        proc.send_signal(signal.SIGINT)
        rest, stderr = proc.communicate(timeout=30)
        stdout = printed + rest
    finally:
        if proc.poll() is None:
            mooncake("down", "--timeout", "5")
            proc.wait(timeout=30)
    assert proc.returncode == 0, stderr.decode(errors="replace")
    started = json.loads(stdout)  # the whole of stdout is one JSON document
    assert started["mode"] == "foreground" and [a["node_id"] for a in started["agents"]] == ["agent-0"]
    assert not any(pid_alive(int(s["pid"])) for s in started["servers"])


def _server_dir(server_pid: int) -> Path:
    """The embedded server's data dir: the server works in it (--dir DIR makes it its cwd)."""
    return Path(os.readlink(f"/proc/{server_pid}/cwd"))


def test_down_removes_the_temp_dir_of_a_server_whose_wrapper_was_killed(
    mooncake: Mooncake, pid_alive: Callable[[int], bool]
) -> None:
    """The wrapper removes the server's temp dir when it stops; killed with SIGKILL it cannot, and
    `down` stopped the server by its recorded pid but left /tmp/mooncake-redis-* for good."""
    state = json.loads(mooncake.ok("up", "--detach", "--agents", "0", "--json").stdout)
    wrapper, server = (int(s["pid"]) for s in state["servers"])
    try:
        directory = _server_dir(server)
        assert directory.name.startswith("mooncake-redis-") and directory.is_dir()
        os.kill(wrapper, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(wrapper) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        down = mooncake("down", "--timeout", "5")
    assert down.returncode == 0, down.stderr
    assert not pid_alive(server)
    assert not directory.exists(), f"{directory} left behind"


def test_a_recorded_cluster_whose_server_died_is_told_to_go_down(
    mooncake: Mooncake, pid_alive: Callable[[int], bool]
) -> None:
    """With the embedded server killed and the agents still running, commands advised `mooncake
    up`, which refuses while a cluster is recorded: the advice went round in a circle."""
    state = json.loads(mooncake.ok("up", "--detach", "--agents", "1", "--host-mem", HOST_MEM, "--json").stdout)
    _, server = (int(s["pid"]) for s in state["servers"])
    try:
        os.kill(server, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        message = assert_one_line_error(mooncake("ls"), 4, "cannot reach Redis", "`mooncake down` stops what is left")
        assert "mooncake up`" in message and "Start a cluster" not in message
        # doctor too (it advised `mooncake up`, review of the twenty-eighth session)
        result = mooncake("doctor")
        doctor = result.stdout.decode() + result.stderr.decode()
        assert "`mooncake down` stops what is left" in doctor and "Start a cluster" not in doctor, doctor
        # and `up`, which said "a cluster is already running" (README walk-through, session 30),
        # once the server's wrapper has seen its server go too
        wrapper = int(state["servers"][0]["pid"])
        deadline = time.monotonic() + 15  # afresh: ls and doctor may have taken the first one's
        while pid_alive(wrapper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert_one_line_error(mooncake("up", "--detach"), 1, "lost its embedded server", "`mooncake down` stops what")
    finally:
        down = mooncake("down", "--timeout", "5")
    assert down.returncode == 0, down.stderr
    assert not any(pid_alive(int(a["pid"])) for a in state["agents"])


def test_up_on_a_port_in_use_says_so_in_one_line(mooncake: Mooncake) -> None:
    """Its error was the server log's last lines, opening with an unrelated warning (memory
    overcommit), after ~25 s spent waiting on a listener that never answered. It is a usage
    error (exit 2), as an agent's --listen port in use is; it was exit 1."""
    with socket.socket() as listener:  # listening, never answering
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = mooncake("up", "--detach", "--agents", "0", "--port", str(port))
    assert result.returncode == 2, result.stderr
    (message,) = [line for line in error_lines(result) if line.startswith("error: ")]  # after "starting ..."
    assert f"port {port} on 127.0.0.1 is already in use" in message and "WARNING" not in message
    assert not (mooncake.state_dir / "cluster.json").exists()


def test_a_put_to_a_cluster_with_no_agent_says_so(mooncake: Mooncake) -> None:
    """It read stdin against a limit of 0 B and blamed the input: "stdin holds more than 0 B"."""
    mooncake.ok("up", "--detach", "--agents", "0")
    try:
        result = mooncake("put", "k", "-", stdin=b"abc")
        assert_one_line_error(result, 5, "the cluster has no live agent to store it on")
    finally:
        assert mooncake("down", "--timeout", "5").returncode == 0
