"""`up` and `down`: every process stopped by PID and every shared-memory segment removed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from helpers import mooncake_bin
from mooncake_cli.procs import start_ticks
from mooncake_cli.state import STATE_VERSION

from .conftest import HOST_MEM, Mooncake

SHM = Path("/dev/shm")


@contextlib.contextmanager
def socket_on_a_free_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _recorded(state: dict[str, object]) -> tuple[list[int], list[str]]:
    pids = [int(a["pid"]) for a in state["agents"]] + [int(s["pid"]) for s in state["servers"]]  # type: ignore[attr-defined]
    return pids, list(state["shm_segments"])  # type: ignore[call-overload]


def test_detached_up_then_down_leaves_nothing(mooncake: Mooncake, pid_alive: Callable[[int], bool]) -> None:
    try:
        up = mooncake.ok("up", "--detach", "--agents", "2", "--host-mem", HOST_MEM, "--json")
        state = json.loads(up.stdout)
        pids, segments = _recorded(state)
        assert len(state["agents"]) == 2 and len(state["servers"]) == 2  # wrapper and the server itself
        # The server's log holds what it says, not the interpreter's runpy warning (error tails show it).
        assert "RuntimeWarning" not in (Path(state["log_dir"]) / "server.log").read_text()
        assert all(pid_alive(p) for p in pids)
        assert all((SHM / s).exists() for s in segments)
        # An agent that crashed cannot remove its own segment: down must.
        os.kill(state["agents"][1]["pid"], signal.SIGKILL)
        mooncake.ok("put", "k", "-", stdin=b"v")
    finally:
        down = mooncake("down", "--timeout", "5")
    assert down.returncode == 0, down.stderr
    assert not any(pid_alive(p) for p in pids)
    assert not any((SHM / s).exists() for s in segments)
    assert not (mooncake.state_dir / "cluster.json").exists()
    assert mooncake("stat").returncode == 4  # nothing recorded any more


def _recorded_when_up(mooncake: Mooncake, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """What a foreground `up` recorded, once it has (within 30 s, or once it exited)."""
    state_file = mooncake.state_dir / "cluster.json"
    deadline = time.monotonic() + 30
    while not state_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return mooncake.state()


def test_foreground_up_stops_everything_on_ctrl_c(mooncake: Mooncake, pid_alive: Callable[[int], bool]) -> None:
    proc = mooncake.popen("up", "--agents", "1", "--host-mem", HOST_MEM)
    state_file = mooncake.state_dir / "cluster.json"
    pids: list[int] = []
    segments: list[str] = []
    try:
        state = _recorded_when_up(mooncake, proc)
        assert state["mode"] == "foreground" and state["owner"]["pid"] == proc.pid
        pids, segments = _recorded(state)
        # Another shell finds the foreground cluster through the state file.
        mooncake.ok("put", "fg", "-", stdin=b"foreground")
        assert mooncake.ok("get", "fg").stdout == b"foreground"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            mooncake("down", "--timeout", "5")
            proc.wait(timeout=30)
    assert not any(pid_alive(p) for p in pids)
    assert not any((SHM / s).exists() for s in segments)
    assert not state_file.exists()
    assert proc.stdout is not None and b"agent-0" in proc.stdout.read()


def test_a_foreground_up_killed_outright_takes_its_cluster_with_it(
    mooncake: Mooncake, pid_alive: Callable[[int], bool]
) -> None:
    """SIGKILL runs no cleanup: the server and agents of a foreground `up` ran on, holding their
    arenas, and the next `up` was refused until a `mooncake down`. They watch it now."""
    proc = mooncake.popen("up", "--agents", "2", "--host-mem", HOST_MEM)
    pids: list[int] = []
    segments: list[str] = []
    try:
        pids, segments = _recorded(_recorded_when_up(mooncake, proc))
        mooncake.ok("put", "fg", "-", stdin=b"foreground")  # up and serving
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20  # a parent check a second, then each one's stop
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in pids), [p for p in pids if pid_alive(p)]
        assert not any((SHM / s).exists() for s in segments)
        # What it recorded names no running process: a new cluster starts.
        mooncake.ok("up", "--detach", "--agents", "1", "--host-mem", HOST_MEM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        mooncake("down", "--timeout", "5")


def test_down_never_signals_processes_recorded_in_another_boot(
    mooncake: Mooncake, pid_alive: Callable[[int], bool]
) -> None:
    """After a reboot a PID and its start time can come again: a state file from another boot names
    no running process, whatever runs under its PIDs now."""
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        ref = {"pid": bystander.pid, "start_ticks": start_ticks(bystander.pid)}
        mooncake.state_dir.mkdir(parents=True, exist_ok=True)
        (mooncake.state_dir / "cluster.json").write_text(
            json.dumps(
                {
                    "version": STATE_VERSION,
                    "redis_url": "redis://127.0.0.1:1/0",
                    "namespace": "default",
                    "mode": "detached",
                    "owner": None,
                    "servers": [ref],
                    "agents": [],
                    "shm_segments": [],
                    "log_dir": "",
                    "started_at": 0.0,
                    "boot_id": "another-boot",
                }
            )
        )
        mooncake("down")
        assert pid_alive(bystander.pid), "down signalled a process recorded in another boot"
    finally:
        bystander.terminate()
        bystander.wait(timeout=10)


def test_an_agent_that_exits_while_up_waits_for_it_is_reported_as_exited(mooncake: Mooncake) -> None:
    """An agent that cannot start exits at once; `up` said it "did not become ready within 30 s"
    (after one second), which sent the reader looking for a hang. Its disk tier's directory cannot
    be made (under /proc), which only the agent finds out."""
    env = {"MOONCAKE_AGENT_DISK_PATH": "/proc/mooncake-cannot-be-here", "MOONCAKE_AGENT_DISK_BYTES": "16MiB"}
    result = mooncake("up", "--detach", "--agents", "1", "--host-mem", "16MiB", env=env)
    text = result.stderr.decode()
    assert result.returncode != 0, text
    assert "agent agent-0 exited with status" in text and "within" not in text, text
    assert "cannot create the disk tier directory /proc/mooncake-cannot-be-here/agent-0: No such file" in text, text
    assert "Errno" not in text, text  # the reason alone, not the OSError's own text repeating the path
    assert not (mooncake.state_dir / "cluster.json").exists()


def test_a_reader_that_leaves_early_is_no_error(mooncake: Mooncake, pid_alive: Callable[[int], bool]) -> None:
    """`mooncake up -d | head -0` exited 1 with no message, its cluster up and recorded all the
    same: the console library exits 1 when the reader of its output leaves. Commands now end with
    0 then, as `get` already did (test_cli_data.py). Here the pipe's reader is gone before the
    command writes a byte. The help too (`mooncake --help | head -1`)."""

    def with_reader_gone(*args: str) -> int:
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            proc = subprocess.run([mooncake_bin(), *args], stdout=write_end, stderr=subprocess.PIPE, env=mooncake.env)
        finally:
            os.close(write_end)
        assert b"Traceback" not in proc.stderr, proc.stderr.decode()
        return proc.returncode

    # The help, which the command line's framework prints with a console of its own.
    assert with_reader_gone("--help") == 0
    assert with_reader_gone("stat", "--help") == 0
    # A command that fails after its output still fails: doctor's checks, then its exit code.
    assert with_reader_gone("doctor", "--redis-url", "redis://127.0.0.1:1") == 4
    try:
        assert with_reader_gone("up", "--detach", "--agents", "1", "--host-mem", HOST_MEM) == 0
        pids, segments = _recorded(mooncake.state())  # up and recorded, as before
        assert all(pid_alive(p) for p in pids)
        mooncake.ok("put", "k", "-", stdin=b"v")
        assert with_reader_gone("stat") == 0
        assert with_reader_gone("ls") == 0
        assert with_reader_gone("get", "k") == 0
    finally:
        assert with_reader_gone("down", "--timeout", "5") == 0
    assert not any(pid_alive(p) for p in pids)
    assert not any((SHM / s).exists() for s in segments)
    assert not (mooncake.state_dir / "cluster.json").exists()


def test_a_namespace_named_anywhere_wins_over_the_recorded_clusters_default_included(
    mooncake: Mooncake, tmp_path: Path
) -> None:
    """With a cluster recorded in namespace "rec": `--namespace default` (and the env's
    MOONCAKE_NAMESPACE=default) was taken for no namespace at all, so `ls`, `get` and `rm` acted
    on "rec"; and `mooncake agent` joined "rec" although the config file named another."""
    agent: subprocess.Popen[bytes] | None = None

    def keys(listing: subprocess.CompletedProcess[bytes]) -> list[str]:
        return [entry["key"] for entry in json.loads(listing.stdout)]

    try:
        mooncake.ok("up", "--detach", "--agents", "1", "--host-mem", HOST_MEM, "--namespace", "rec")
        mooncake.ok("put", "k", "-", stdin=b"v")  # no namespace named: the recorded one's
        assert keys(mooncake.ok("ls", "--json")) == ["k"]
        assert keys(mooncake.ok("ls", "--json", "--namespace", "default")) == []
        assert keys(mooncake.ok("ls", "--json", env={"MOONCAKE_NAMESPACE": "default"})) == []
        assert mooncake("rm", "k", "--namespace", "default").returncode == 3  # not found there
        assert keys(mooncake.ok("ls", "--json")) == ["k"]
        config = tmp_path / "agent.toml"
        config.write_text('namespace = "cfg"\n')
        agent = mooncake.popen("agent", "--config", str(config), "--host-mem", "16MiB", "--node-id", "from-file")
        deadline = time.monotonic() + 30

        def nodes(namespace: str) -> list[str]:
            stat = json.loads(mooncake.ok("stat", "--json", "--namespace", namespace).stdout)
            return [n["node_id"] for n in stat["nodes"]]

        while "from-file" not in nodes("cfg") and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "from-file" in nodes("cfg"), agent.stderr.read().decode() if agent.poll() is not None else "not there"
        assert "from-file" not in nodes("rec")
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=20)
            for stream in (agent.stdout, agent.stderr):
                if stream is not None:
                    stream.close()
        mooncake("down", "--timeout", "5")
