"""Configuration and multi-host review (session 29). An advertised address was taken as given: a
host peers cannot dial ("h o s t", "256.1.1.1"), a fixed port beside a listen port of 0 (never
the one bound), another live agent's address (every put for the node went to that agent and
failed as a reservation of an agent "restarted since"), or an address nothing answers; doctor
said ✓ for all of them. An empty --node-id was "not given"; a database the server lacks was
"cannot reach Redis ... start a cluster"."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_store import LocalCluster, connect
from mooncake_store.config import AgentConfig, load_config
from mooncake_store.errors import ConfigError

from .conftest import Mooncake, assert_one_line_error

REPO = Path(__file__).resolve().parents[2]


def _port() -> int:
    """A port of 127.0.0.1 that nothing listens on (closed once its number is known)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(num_agents=1, host_bytes=8 << 20, namespace=f"t-{uuid.uuid4().hex[:10]}") as running:
        yield running


def _agent(cluster: LocalCluster, *args: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "mooncake_store.agent", "--redis-url", cluster.redis_url,
        "--namespace", cluster.namespace, "--host-bytes", "4MiB", "--no-prefault", *args,
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Its output once it has ended; stopped by its own pid if it still runs (SIGTERM first, so
    that an agent that started after all removes its arena)."""
    try:
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.parametrize("host", ["h o s t", "256.1.1.1", "a..b", "-x"])
def test_an_advertised_host_peers_cannot_dial_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="neither an IP address nor a host name"):
        load_config(env={}, overrides={"agent.advertise": f"{host}:7000"})


def test_an_advertised_port_beside_a_listen_port_of_zero_is_refused() -> None:
    with pytest.raises(ConfigError, match="binds any free port"):
        AgentConfig(advertise="127.0.0.1:7000").check_published_endpoint()
    AgentConfig(advertise="node-7:7000", listen="0.0.0.0:7000").check_published_endpoint()  # as compose does


def test_an_agent_advertising_another_agents_address_is_refused(cluster: LocalCluster) -> None:
    taken = cluster.agents[0].endpoint
    proc = _agent(cluster, "--listen", f"127.0.0.1:{_port()}", "--advertise", taken, "--node-id", "copy-paste")
    out, err = _stop(proc)
    assert proc.returncode == 2, (out, err)
    assert "is answered by another agent" in err and taken in err, err
    assert "READY" not in out
    with connect(cluster.redis_url, namespace=cluster.namespace) as client:
        assert "copy-paste" not in {n.node_id for n in client.stat().nodes}


def test_doctor_names_a_live_agent_whose_endpoint_does_not_answer(cluster: LocalCluster, mooncake: Mooncake) -> None:
    nowhere = f"127.0.0.1:{_port()}"
    proc = _agent(cluster, "--listen", f"127.0.0.1:{_port()}", "--advertise", nowhere, "--node-id", "astray")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # started all the same: behind NAT an address need not reach back
        assert line.startswith("READY "), line
        result = mooncake("doctor", "--json", "--redis-url", cluster.redis_url, "--namespace", cluster.namespace)
        checks = {c["name"]: c for c in json.loads(result.stdout)}
        assert result.returncode == 0, checks  # one of two: a warning
        assert checks["endpoints"]["status"] == "warn", checks["endpoints"]
        assert f"astray at {nowhere} does not answer" in checks["endpoints"]["detail"]
        assert cluster.agents[0].node_id not in checks["endpoints"]["detail"]
    finally:
        proc.terminate()
        _, err = _stop(proc)
    assert f"agent.advertise={nowhere} does not answer" in err and "this agent's own PING" in err


def test_an_empty_node_id_is_refused(cluster: LocalCluster) -> None:
    proc = _agent(cluster, "--node-id", "")
    out, err = _stop(proc)
    assert proc.returncode == 2, (out, err)
    assert "--node-id is empty" in err


def test_a_database_the_server_lacks_is_a_usage_error(cluster: LocalCluster, mooncake: Mooncake) -> None:
    url = cluster.redis_url.rsplit("/", 1)[0] + "/16"
    line = assert_one_line_error(mooncake("stat", "--redis-url", url), 2, "has no database 16", "DB index")
    assert "mooncake up" not in line  # no advice to start a cluster: this one is up


def test_an_interval_at_or_above_the_default_ttl_blames_the_interval() -> None:
    """It blamed agent.heartbeat_ttl_s=5.0, which the user never set."""
    with pytest.raises(ConfigError, match=r"MOONCAKE_AGENT_HEARTBEAT_INTERVAL_S=.*must be below agent.heartbeat_ttl_s"):
        load_config(env={"MOONCAKE_AGENT_HEARTBEAT_INTERVAL_S": "6"})
    # As given, not as parsed (it said '6.0'; session 30).
    with pytest.raises(ConfigError, match=r"HEARTBEAT_INTERVAL_S='6e0': must be below"):
        load_config(env={"MOONCAKE_AGENT_HEARTBEAT_INTERVAL_S": "6e0"})


def test_a_variable_one_case_away_is_suggested() -> None:
    with pytest.raises(ConfigError, match=r"did you mean MOONCAKE_AGENT_HOST_BYTES\?"):
        load_config(env={"MOONCAKE_AGENT_host_bytes": "1GiB"})


@pytest.mark.parametrize("kind", ["dangling link", "directory"])
def test_a_default_config_file_that_cannot_be_read_is_an_error(tmp_path: Path, kind: str) -> None:
    """It was passed over for the defaults, the operator's settings silently gone."""
    path = tmp_path / "mooncake" / "config.toml"
    path.parent.mkdir()
    if kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "moved-away.toml")
    with pytest.raises(ConfigError, match="the default config file is there but is no file it can read"):
        load_config(env={"XDG_CONFIG_HOME": str(tmp_path)})


def test_a_key_set_twice_in_one_file_is_refused(tmp_path: Path) -> None:
    """The table's value won over the dotted key's, unsaid."""
    path = tmp_path / "config.toml"
    path.write_text('"agent.host_bytes" = "2GiB"\n\n[agent]\nhost_bytes = "3GiB"\n')
    with pytest.raises(ConfigError, match=r"agent\.host_bytes is set twice"):
        load_config(file=path, env={})


def test_an_empty_node_id_from_the_environment_is_refused() -> None:
    """As --node-id "": a compose file's ${NODE} left unset (second diff review)."""
    with pytest.raises(ConfigError, match="env MOONCAKE_AGENT_NODE_ID is empty"):
        load_config(env={"MOONCAKE_AGENT_NODE_ID": ""})


def test_doctor_calls_a_database_the_server_lacks_bad_input(cluster: LocalCluster, mooncake: Mooncake) -> None:
    """It exited 4, "cannot be reached", where every other command now exits 2."""
    url = cluster.redis_url.rsplit("/", 1)[0] + "/16"
    result = mooncake("doctor", "--json", "--redis-url", url)
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert result.returncode == 2, checks
    assert checks["redis"]["status"] == "fail" and "has no database 16" in checks["redis"]["detail"]


@contextlib.contextmanager
def _web_server() -> Iterator[int]:
    """A port of 127.0.0.1 where one connection gets an HTTP answer to whatever it sends."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        server.settimeout(30)

        def serve_one() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 40)

        thread = threading.Thread(target=serve_one)
        thread.start()
        try:
            yield server.getsockname()[1]
        finally:
            thread.join(30)


def test_an_address_answered_by_another_protocol_is_told_from_one_that_does_not_answer() -> None:
    """It read "does not answer (bad frame magic b'HT' ...)" for a web server at the address."""
    from mooncake_store.agent.self_check import who_answers

    with _web_server() as port:
        problem = who_answers(f"127.0.0.1:{port}", "any-arena", timeout_s=5.0)
    assert problem is not None and problem.answered, problem
    assert str(problem).startswith("answers, but not in this build's protocol (bad frame magic"), problem


def test_an_agent_advertising_an_address_another_service_answers_is_refused(cluster: LocalCluster) -> None:
    """It logged a garbled warning about NAT and started, published at a web server's address."""
    with _web_server() as port:
        proc = _agent(cluster, "--listen", f"127.0.0.1:{_port()}", "--advertise", f"127.0.0.1:{port}")
        out, err = _stop(proc)
    assert proc.returncode == 2, (out, err)
    assert "answers, but not in this build's protocol" in err and "give this node's own address" in err, err
