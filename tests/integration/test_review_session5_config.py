"""Review session 5: configuration handling (config/, the agent's and the CLI's use of it).

Each test names one bug and fails on the code as reviewed. DESIGN.md invariant 6: every input from
outside is checked; bad input gets a MooncakeError subclass whose message names the value and the
limit. README: defaults < TOML < MOONCAKE_* env < flags; bad values fail at load with ConfigError
naming the key, the value and where it came from.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import mooncake_bin

from mooncake_store import connect
from mooncake_store.config import AgentConfig, load_config
from mooncake_store.errors import ConfigError, ConnectError, MooncakeError

# --- helpers ----------------------------------------------------------------------------------------


def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No MOONCAKE_* or user config file from the caller leaks into a load."""
    for var in [v for v in os.environ if v.startswith("MOONCAKE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli_env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    env.update(
        MOONCAKE_STATE_DIR=str(root / "state"),
        XDG_CONFIG_HOME=str(root / "xdg-config"),
        NO_COLOR="1",
        COLUMNS="200",
    )
    env.update(extra)
    return env


def _run_cli(
    root: Path, *args: str, extra: dict[str, str], timeout: float = 90.0
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [mooncake_bin(), *args], capture_output=True, env=_cli_env(root, extra), timeout=timeout, check=False
    )


def _stop_recorded_cluster(root: Path, extra: dict[str, str]) -> None:
    """`mooncake down`, and should that fail, SIGTERM the agents the state file records (by PID)."""
    state_file = root / "state" / "cluster.json"
    recorded: dict[str, Any] = {}
    if state_file.exists():
        recorded = json.loads(state_file.read_text())
    stopped = False
    try:
        stopped = _run_cli(root, "down", "--timeout", "5", extra=extra, timeout=60).returncode == 0
    finally:
        if not stopped:
            for agent in recorded.get("agents", []):
                pid = int(agent.get("pid", 0))
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if pid > 0 else b""
                except OSError:
                    continue
                if b"mooncake_store.agent" in cmdline:
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass


# --- 1. raw ValueError from a port written in non-ASCII digits ------------------------------------------


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("MOONCAKE_AGENT_LISTEN", "127.0.0.1:\u00b2"),  # superscript two: str.isdigit() is True, int() fails
        ("MOONCAKE_AGENT_ADVERTISE", "agent-1:\u00b9"),
    ],
)
def test_port_with_non_ascii_digit_raises_config_error_not_valueerror(var: str, value: str) -> None:
    """values.py _parse_host_port checks port_text.isdigit() and then calls int(port_text): '²' passes
    the first and breaks the second, so load_config raises a bare ValueError (no key, no source)."""
    try:
        load_config(env={var: value})
    except ConfigError as exc:
        assert str(exc).startswith(f"env {var}="), str(exc)
        return
    except Exception as exc:  # the bug: a builtin exception escapes the loader
        pytest.fail(f"load_config raised {type(exc).__name__}: {exc} instead of ConfigError")
    pytest.fail(f"{var}={value!r} was accepted")


# --- 2. redis URLs accepted at load that the Redis client cannot use -----------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/\u00b2",  # db '²': isdigit() but not a number redis-py can parse
        "redis://127.0.0.1:6379/0?db=abc",  # a query option redis-py refuses
    ],
)
def test_redis_url_that_redis_py_rejects_fails_at_load(url: str) -> None:
    """checks.py _check_redis_url accepts these; the failure comes later, at connect, as a
    ConnectError ('bad Redis URL', exit 4 'cannot connect') instead of a ConfigError at load (exit 2)."""
    # An env value is named by its variable (env MOONCAKE_REDIS_URL=...), hence the case-insensitive match.
    with pytest.raises(ConfigError, match=r"(?i)redis_url"):
        load_config(env={"MOONCAKE_REDIS_URL": url})


# --- 3. the Redis password leaks into ConnectError messages -------------------------------------------


@pytest.mark.parametrize("suffix", ["/0", "/0?db=abc"])
def test_connect_error_does_not_print_the_redis_password(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, suffix: str
) -> None:
    """index/client.py connect_redis formats the raw URL into both of its ConnectErrors ('bad Redis URL
    ...' and 'cannot reach Redis at ...'); the CLI prints that line, so the password ends up on
    terminals and in logs, while config errors redact it (redact_url)."""
    _clean_env(monkeypatch, tmp_path)
    url = f"redis://user:hunter2secret@127.0.0.1:{_closed_port()}{suffix}"
    # Bypass the config check so the second case reaches connect_redis whatever bug 2's fix does.
    from mooncake_store.index.connection import connect_redis

    with pytest.raises(ConnectError) as info:
        connect_redis(url, timeout_s=2.0)
    assert "hunter2secret" not in str(info.value), str(info.value)


# --- 4. MOONCAKE_ZONE: read by the client, refused by the loader ----------------------------------------


def test_client_zone_env_var_is_not_rejected_by_connect(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str
) -> None:
    """client/client.py:69 takes the writer's zone (placement: 'least loaded node of the writer's
    zone') from MOONCAKE_ZONE, but loader._read_env rejects every MOONCAKE_* variable that is not a
    config key or in NON_CONFIG_ENV_VARS, so connect() with MOONCAKE_ZONE set always fails: the
    client's zone cannot be set at all through the public API."""
    _clean_env(monkeypatch, tmp_path)
    monkeypatch.setenv("MOONCAKE_ZONE", "rack-1")
    client = connect(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}")
    try:
        assert client.zone == "rack-1"
        assert client.config.zone == "rack-1"  # the alias lands in the config field client.zone
    finally:
        client.close()


# --- 5. cross-field errors lose where the value came from --------------------------------------------


def test_watermark_error_names_the_variable_that_was_set() -> None:
    """loader.load_config passes only the low watermark's source to _check_watermarks: with only
    MOONCAKE_AGENT_HIGH_WATERMARK=0.5 set, the message blames the default low watermark and never says
    which variable or layer set high (compare the heartbeat check, which names both sources)."""
    with pytest.raises(ConfigError) as info:
        load_config(env={"MOONCAKE_AGENT_HIGH_WATERMARK": "0.5"})
    assert "MOONCAKE_AGENT_HIGH_WATERMARK" in str(info.value), str(info.value)


def test_disk_bytes_without_path_error_names_source_and_value() -> None:
    """tree._validate_instance raises 'agent.disk_bytes=1073741824 needs agent.disk_path' from the
    dataclass, after the loader has dropped where the value came from and how the user wrote it."""
    with pytest.raises(ConfigError) as info:
        load_config(env={"MOONCAKE_AGENT_DISK_BYTES": "1GiB"})
    message = str(info.value)
    assert "MOONCAKE_AGENT_DISK_BYTES" in message, message
    assert "'1GiB'" in message, message


# --- 6. a disk directory without a capacity silently means "no disk tier" ----------------------------


@pytest.mark.parametrize("overrides", [{}, {"agent.disk_bytes": "0"}])
def test_disk_path_without_disk_bytes_is_refused(tmp_path: Path, overrides: dict[str, str]) -> None:
    """`--disk DIR` without `--disk-mem` (or with --disk-mem 0) loads fine and the agent runs with no
    disk tier (node.py builds DiskTier only `if config.disk_bytes`): the user asked for a tier and
    silently got none. The reverse (disk_bytes without disk_path) is already a ConfigError."""
    with pytest.raises(ConfigError, match="disk"):
        load_config(env={}, overrides={"agent.disk_path": str(tmp_path / "disk"), **overrides})


def test_disk_path_with_nul_byte_is_a_config_error(tmp_path: Path) -> None:
    """agent.disk_path is a plain 'str' field with no check: a TOML "\\u0000" in it loads, then
    DiskTier's mkdir raises a bare ValueError('embedded null byte'): a traceback from
    `python -m mooncake_store.agent`, 'internal error' from `mooncake agent`."""
    path = tmp_path / "config.toml"
    path.write_text('[agent]\ndisk_path = "/tmp/a\\u0000b"\ndisk_bytes = "1MiB"\n')
    with pytest.raises(ConfigError, match="disk_path"):
        load_config(file=path, env={})


# --- 7. advertise with port 0 ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["agent-1:0", "10.0.0.5:0"])
def test_advertise_port_zero_is_refused(value: str) -> None:
    """checks.py uses the listen check for advertise, which allows port 0 (bind to any port). An
    advertised endpoint is what peers dial; port 0 is never dialable, yet it is published as is
    (node.py: tcp_endpoint=self.config.advertise or ...)."""
    with pytest.raises(ConfigError, match="advertise"):
        load_config(env={}, overrides={"agent.advertise": value})
    with pytest.raises(ConfigError, match="advertise"):
        AgentConfig(advertise=value)


# --- 8. IPv6 listen addresses, which the config accepts, never bind --------------------------------------


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_agent_can_listen_on_ipv6_loopback(make_inproc_agent: Callable[..., Any]) -> None:
    """The config's own example is '[::1]:0' (split_host_port accepts it), but agent/server.py:89
    kept the brackets for port 0 (getaddrinfo('[::1]') failed) and socket.create_server() was called
    without family=AF_INET6 for a non-zero port ('Address family for hostname not supported'): every
    IPv6 listen address failed at start with ConnectError. On a host with no IPv6 loopback the
    agent must still say so clearly (ConnectError naming the address), not crash."""
    if not _ipv6_loopback():
        with pytest.raises(ConnectError, match=re.escape("[::1]:0")):
            make_inproc_agent(listen="[::1]:0")
        return
    agent = make_inproc_agent(listen="[::1]:0")
    host, _, port = agent.server.endpoint.rpartition(":")
    assert int(port) > 0
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
        pass


# --- 9. a wildcard listen address is published as the endpoint peers dial ------------------------------


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "0", "0x0", "0.0.0.00", "000.000.000.000", "[::]"])
def test_wildcard_listen_is_not_published_as_the_endpoint(make_inproc_agent: Callable[..., Any], wildcard: str) -> None:
    """README 'Running agents yourself' shows `--listen 0.0.0.0:7000` with no --advertise. The agent
    then publishes tcp_endpoint '0.0.0.0:7000' (node.py:319, server.endpoint is the bind host), which a
    client on another host dials as its *own* host: the node is unreachable, or (same fixed port on
    every node) the client talks to the wrong agent. It should publish a routable address or refuse
    the wildcard without --advertise. The socket layer binds "0", "0x0" or "0.0.0.00" (inet_aton's
    spellings) as 0.0.0.0 too; those were published as endpoints, bound to every interface."""
    with pytest.raises(ConfigError, match="advertise"):  # refused: peers could not dial it
        make_inproc_agent(listen=f"{wildcard}:0")


# --- 10. a disk capacity far beyond the filesystem is accepted and advertised -----------------------


def test_disk_capacity_beyond_the_filesystem_is_refused(make_inproc_agent: Callable[..., Any], tmp_path: Path) -> None:
    """The host tier refuses a size beyond /dev/shm (NoCapacity), the GPU tier one beyond free device
    memory; DiskTier never looks at the filesystem, so disk_bytes=4 EiB on a small disk starts, and
    the node table advertises 4 EiB of disk room that placement and spills then count on."""
    huge = 1 << 62
    with pytest.raises(MooncakeError) as info:
        make_inproc_agent(disk_path=str(tmp_path / "disk"), disk_bytes=huge)
    assert str(huge) in str(info.value) or "4.0 EiB" in str(info.value), str(info.value)


# --- 11. `mooncake up` ignores MOONCAKE_AGENT_HOST_BYTES / [agent] host_bytes ------------------------


@pytest.mark.timeout(180)
def test_up_host_mem_defaults_to_env_not_hardcoded_1gib(tmp_path: Path, redis_url: str) -> None:
    """cli/commands/cluster.py up(): --host-mem defaults to the literal "1GiB" and is always passed to
    the agents as --host-bytes, so MOONCAKE_AGENT_HOST_BYTES (or host_bytes in the config file) is
    overridden by a flag the user never gave. README: defaults < file < env < flags."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    extra = {
        "MOONCAKE_REDIS_URL": redis_url,  # an existing server: no embedded one to start
        "MOONCAKE_NAMESPACE": namespace,
        "MOONCAKE_AGENT_HOST_BYTES": "8MiB",
        "MOONCAKE_AGENT_PREFAULT": "0",  # whatever size the agent takes, touch no pages
    }
    try:
        result = _run_cli(tmp_path, "up", "--detach", "--agents", "1", extra=extra)
        assert result.returncode == 0, result.stderr.decode(errors="replace")
        client = connect(redis_url, namespace=namespace)
        try:
            stats = client.stat()
        finally:
            client.close()
        capacities = [t.capacity_bytes for n in stats.nodes for t in n.tiers if str(t.tier) == "host"]
        assert capacities == [8 << 20], capacities
    finally:
        _stop_recorded_cluster(tmp_path, extra)


# --- 12. `mooncake up --zone` is not checked before processes start ----------------------------------


@pytest.mark.timeout(180)
def test_up_bad_zone_is_a_usage_error_before_anything_starts(tmp_path: Path, redis_url: str) -> None:
    """up() validates --redis-url and --namespace through load_config but passes --zone straight to
    the agents: `mooncake up --zone 'rack 7'` starts processes, then exits 1 with 'agent agent-0 did not
    become ready within 30 s: error: override agent.zone=...' (it failed at once). README: bad input
    exits 2."""
    extra = {"MOONCAKE_REDIS_URL": redis_url, "MOONCAKE_NAMESPACE": f"t-{uuid.uuid4().hex[:10]}"}
    try:
        result = _run_cli(tmp_path, "up", "--detach", "--agents", "1", "--zone", "rack 7", extra=extra)
        stderr = result.stderr.decode(errors="replace")
        assert result.returncode == 2, (result.returncode, stderr)
        assert "zone" in stderr and "rack 7" in stderr, stderr
        assert "did not become ready" not in stderr, stderr
    finally:
        _stop_recorded_cluster(tmp_path, extra)


# --- 13. `mooncake agent` cannot enable the GPU tier ----------------------------------------------------


@pytest.mark.timeout(120)
def test_mooncake_agent_accepts_gpu_flags(tmp_path: Path, redis_url: str) -> None:
    """README (Tiers): the GPU tier is `--gpu-mem SIZE --gpu-id N`, and `mooncake agent` is what each
    node runs; but only `python -m mooncake_store.agent` has those flags: `mooncake agent --gpu-mem`
    is 'No such option' (exit 2). With the flags, device 1023 does not exist, so the agent must refuse
    to start with a GPU error (exit 1), never run without the tier."""
    extra = {"MOONCAKE_AGENT_PREFAULT": "0"}
    result = _run_cli(
        tmp_path,
        "agent",
        "--redis-url",
        redis_url,
        "--namespace",
        f"t-{uuid.uuid4().hex[:10]}",
        "--host-mem",
        "4MiB",
        "--gpu-mem",
        "64MiB",
        "--gpu-id",
        "1023",
        extra=extra,
        timeout=60,
    )
    stderr = result.stderr.decode(errors="replace")
    assert "No such option" not in stderr, stderr
    assert result.returncode == 1 and "gpu" in stderr.lower(), (result.returncode, stderr)


def test_mooncake_zone_sets_the_zone_of_agents_and_clients_alike() -> None:
    """MOONCAKE_ZONE names the node's zone: an agent run with it must not stay in "default"
    without a word; MOONCAKE_AGENT_ZONE / MOONCAKE_CLIENT_ZONE win for their own side."""
    config = load_config(env={"MOONCAKE_ZONE": "rack-3"})
    assert config.agent.zone == "rack-3" and config.client.zone == "rack-3"
    config = load_config(env={"MOONCAKE_ZONE": "rack-3", "MOONCAKE_AGENT_ZONE": "rack-4"})
    assert config.agent.zone == "rack-4" and config.client.zone == "rack-3"
