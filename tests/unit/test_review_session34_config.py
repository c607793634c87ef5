"""Config values that escaped as a bare ValueError, OverflowError or UnicodeEncodeError instead of a
ConfigError naming the key, the value and the limit; and a TTL refused in the name of a key the user
never set (which LocalCluster's own pre-check let through, after which its agents exited)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from mooncake_store import LocalCluster
from mooncake_store.config import AgentConfig, ClientConfig, load_config
from mooncake_store.embedded import EmbeddedServer
from mooncake_store.errors import ConfigError, ServerError

MANY_DIGITS = "1" * 5000  # past Python's 4300-digit int/str conversion limit


def test_an_int_key_of_many_digits_from_env_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"MOONCAKE_CLIENT_LEASE_MS=.*an integer of 5000 digits, far out of range"):
        load_config(env={"MOONCAKE_CLIENT_LEASE_MS": MANY_DIGITS})


@pytest.mark.parametrize(("text", "expected"), [("0" * 5000 + "2500", 2500), ("+" + "0" * 5000 + "7", 7)])
def test_an_int_key_with_thousands_of_leading_zeros_is_read_as_its_number(text: str, expected: int) -> None:
    """Leading zeros count for nothing: past 4300 of them int() raised a bare ValueError, an
    internal error at the CLI, while the digit count that guards it had stripped them."""
    assert load_config(env={"MOONCAKE_CLIENT_LEASE_MS": text}).client.lease_ms == expected


def test_a_negative_int_key_with_thousands_of_leading_zeros_is_refused_by_its_range() -> None:
    with pytest.raises(ConfigError, match=r"MOONCAKE_CLIENT_LEASE_MS=.*must be >= 1 ms"):
        load_config(env={"MOONCAKE_CLIENT_LEASE_MS": "-" + "0" * 5000 + "3"})


def test_an_int_of_many_digits_in_the_toml_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[client]\nlease_ms = {MANY_DIGITS}\n")
    with pytest.raises(ConfigError, match=f"file {path}: not valid TOML"):
        load_config(file=path, env={})


@pytest.mark.parametrize(
    ("build", "key"),
    [(lambda: AgentConfig(host_bytes=10**5000), "host_bytes"), (lambda: ClientConfig(lease_ms=10**5000), "lease_ms")],
)
def test_a_dataclass_given_a_huge_int_is_a_config_error(build: Callable[[], object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}=<an integer of about 5001 digits>"):
        build()


def test_a_huge_int_for_a_float_key_in_the_toml_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[client]\ntimeout_s = 1" + "0" * 400 + "\n")
    with pytest.raises(ConfigError, match=r"client.timeout_s=.*past float range"):
        load_config(file=path, env={})


def test_a_huge_int_ttl_given_to_local_cluster_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="heartbeat_ttl_s"):
        LocalCluster(1, heartbeat_ttl_s=10**400)


def test_an_advertise_host_that_is_not_utf8_is_a_config_error() -> None:
    # os.environ holds b"\xff:7000" as "\udcff:7000" (surrogateescape)
    with pytest.raises(ConfigError, match=r"MOONCAKE_AGENT_ADVERTISE=.*neither an IP address nor a host name"):
        load_config(env={"MOONCAKE_AGENT_ADVERTISE": "\udcff:7000"})


def test_a_listen_host_that_is_not_utf8_is_refused_at_load() -> None:
    """Accepted by the loader, it failed at bind, as an internal error with a traceback."""
    with pytest.raises(ConfigError, match=r"MOONCAKE_AGENT_LISTEN=.*neither an IP address nor a host name to listen"):
        load_config(env={"MOONCAKE_AGENT_LISTEN": "\udcff:0"})
    for fine in ("0.0.0.0:0", "[::]:0", "localhost:0", "127.0.0.1:7000", "127.1:0"):  # 127.1: bind() takes it
        assert load_config(env={"MOONCAKE_AGENT_LISTEN": fine}).agent.listen == fine


def test_a_small_ttl_is_refused_in_its_own_name() -> None:
    """Only the TTL was given; the interval follows it (a third), and that derived interval was then
    refused as `agent.heartbeat_interval_s=0.000666...`, a key the user never set, with no source."""
    with pytest.raises(ConfigError, match=r"^env MOONCAKE_AGENT_HEARTBEAT_TTL_S='0.002': must be >= 0.003 s when"):
        load_config(env={"MOONCAKE_AGENT_HEARTBEAT_TTL_S": "0.002"})
    assert load_config(env={"MOONCAKE_AGENT_HEARTBEAT_TTL_S": "0.003"}).agent.heartbeat_interval_s >= 0.001


def test_local_cluster_refuses_a_ttl_its_agents_would_refuse_before_it_starts_anything() -> None:
    """Checked against an interval of 1 ms, a TTL of 2 ms passed; the agents, given no interval,
    took a third of it and refused that: the server was started, then each agent exited with 2."""
    with pytest.raises(ConfigError, match=r"^heartbeat_ttl_s=0.002: must be >= 0.003 s"):
        LocalCluster(1, host_bytes=16 << 20, heartbeat_ttl_s=0.002)


def test_an_infinite_startup_timeout_is_refused() -> None:
    """inf passed the "> 0" checks, and a start that never came up was waited for forever."""
    with pytest.raises(ServerError, match=r"startup_timeout_s=inf: must be a number > 0 and <= 3600"):
        EmbeddedServer(startup_timeout_s=float("inf"))
    for bad in (float("inf"), float("nan"), 3601):
        with pytest.raises(ConfigError, match=r"startup_timeout_s must be a number of seconds > 0 and <= 3600, got"):
            LocalCluster(1, startup_timeout_s=bad)


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ('[CLIENT]\nzone = "a"\n', "unknown key CLIENT (did you mean client?)"),
        ('NAMESPACE = "x"\n', "unknown key NAMESPACE (did you mean namespace?)"),
        ("[agent]\nHOST_BYTES = 5\n", "unknown key agent.HOST_BYTES (did you mean agent.host_bytes?)"),
    ],
)
def test_a_file_key_a_case_away_from_a_known_one_gets_the_hint(tmp_path: Path, text: str, hint: str) -> None:
    """README: the nearest known name for a misspelt key, case aside. File keys were compared
    case-sensitively (the environment's upper-cased), and these got no hint at all."""
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(hint)):
        load_config(file=path, env={})
