"""A server started over a persist_dir loads its append-only file before it serves: meanwhile it
answers INFO, and every other command with LOADING. EmbeddedServer.start() waited for INFO alone,
so it returned a server whose first command (an agent's registration, a client's lookup) failed
with BusyLoadingError. start() now returns once the data is loaded, and a load that outlasts
startup_timeout_s is a ServerError that says so. An index client that meets a loading server (one
it did not start) says the server is loading, not that the connection was lost."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers import wait_until

from mooncake_store.embedded import EmbeddedServer, find_server_binary
from mooncake_store.errors import ConnectError, ServerError
from mooncake_store.index.client import RedisIndex

#: Keys in the data, each loaded with a pause (SLOW_LOAD): about 1.6 s of loading in all, on any
#: machine. Loaded at full speed, 300,000 keys took half a second here, and a faster machine could
#: have finished the load before a test could ask, or within the start's budget of 0.2 s.
KEYS = 10_000
#: The server's own debug settings: a pause of 50 us after each key it loads, and events (INFO,
#: the LOADING answers) served every KiB of the file rather than every 2 MiB, so that the
#: server answers throughout the load.
SLOW_LOAD = ["--key-load-delay", "50", "--loading-process-events-interval-bytes", "1024"]


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A persist_dir holding KEYS keys; each test works on its own copy."""
    persist_dir = tmp_path_factory.mktemp("filled") / "data"
    _fill(persist_dir)
    return persist_dir


@pytest.fixture
def data(filled: Path, tmp_path: Path) -> Iterator[Path]:
    shutil.copytree(filled, tmp_path / "data")
    yield tmp_path / "data"


@pytest.fixture
def slow_loading_server(tmp_path: Path) -> Path:
    """The server binary behind a wrapper that adds SLOW_LOAD (it execs the server, as a wrapper
    given to EmbeddedServer must)."""
    wrapper = tmp_path / "slow-loading-server"
    wrapper.write_text(f'#!/bin/sh\nexec "{find_server_binary()}" "$@" {" ".join(SLOW_LOAD)}\n')
    wrapper.chmod(0o755)
    return wrapper


def _fill(persist_dir: Path) -> None:
    server = EmbeddedServer(persist_dir=persist_dir).start()
    try:
        client = server.client()
        pipe = client.pipeline(transaction=False)
        for i in range(KEYS):
            pipe.set(f"key:{i}", b"x" * 100)
        pipe.execute()
        assert client.dbsize() == KEYS
        # Rewritten into the file's RDB base, which the server loads key by key with the pause and
        # serving events by the KiB (SLOW_LOAD); the commands of an AOF it serves every 1024.
        client.bgrewriteaof()
        assert wait_until(lambda: not _rewriting(client), timeout_s=30), "the AOF rewrite did not end"
        client.close()
    finally:
        server.stop()


def _rewriting(client: redis.Redis) -> bool:
    info = client.info("persistence")
    return bool(int(info["aof_rewrite_in_progress"]) or int(info["aof_rewrite_scheduled"]))


def test_a_server_started_over_its_data_serves_once_start_returns(data: Path, slow_loading_server: Path) -> None:
    server = EmbeddedServer(persist_dir=data, binary=slow_loading_server, startup_timeout_s=60).start()
    try:
        client = server.client()
        assert client.set("first", b"1")  # BusyLoadingError while the file was still loading
        assert client.dbsize() == KEYS + 1
        client.close()
    finally:
        server.stop()
    assert not server.running

    # A load that outlasts the start's budget fails the start, in words, and leaves no server.
    slow = EmbeddedServer(persist_dir=data, binary=slow_loading_server, startup_timeout_s=0.2)
    with pytest.raises(ServerError, match=r"did not (finish loading .*data|answer) on 127\.0\.0\.1:\d+ within 0.2 s"):
        slow.start()
    assert not slow.running


def _start_by_hand(data: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """The server over ``data``, started without EmbeddedServer (which waits for the load)."""
    command = [str(find_server_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "yes", "--dir", str(data), "--logfile", str(log), *SLOW_LOAD]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _loading(probe: redis.Redis) -> int | None:
    try:
        return int(probe.info("persistence")["loading"])
    except redis.ConnectionError:
        return None  # not listening yet


def test_index_clients_meeting_a_loading_server_wait_for_it_or_say_it_is_loading(data: Path, tmp_path: Path) -> None:
    """Asked while the server loads (INFO answers from its first moment; the load takes about
    1.6 s): a new index client waits for the load within its timeout (it failed with
    "cannot reach Redis", advised to start a cluster), and a call of a client made before the
    restart says the server is loading (it said "lost the connection")."""
    first = EmbeddedServer(persist_dir=data, startup_timeout_s=60).start()
    url = first.url
    before = RedisIndex(url, namespace="loading", timeout_s=5.0)
    probe = redis.Redis(port=first.port, socket_connect_timeout=0.5)
    proc: subprocess.Popen[bytes] | None = None
    try:
        assert before.lookup(["k"], lease_ms=1000, counted=False).objects == [None]
        first.stop()
        proc = _start_by_hand(data, first.port, tmp_path / "server.log")
        assert wait_until(lambda: _loading(probe) is not None, timeout_s=10, interval_s=0.005), proc.poll()
        assert _loading(probe) == 1, "the load ended before the test could ask"
        with pytest.raises(ConnectError, match=r"is loading its data \(it restarted\) and answers no lookup"):
            before.lookup(["k"], lease_ms=1000, counted=False)
        assert _loading(probe) == 1, "the load ended before the test could ask"
        after = RedisIndex(url, namespace="loading", timeout_s=30.0)  # waits for the load
        try:
            assert _loading(probe) == 0
            assert after.lookup(["k"], lease_ms=1000, counted=False).objects == [None]
            assert before.lookup(["k"], lease_ms=1000, counted=False).objects == [None]
        finally:
            after.close()
    finally:
        before.close()
        probe.close()
        first.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
