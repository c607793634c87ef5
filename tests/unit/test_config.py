"""Config loading: layer precedence, coercion, validation, and error messages that name key, value and source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mooncake_store.config import (
    AgentConfig,
    ClientConfig,
    Config,
    format_size,
    load_config,
    parse_size,
    redact_url,
    split_host_port,
)
from mooncake_store.errors import ConfigError


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


# --- sizes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 << 20),
        ("1GiB", 1 << 30),
        ("1gib", 1 << 30),
        ("1.5GiB", 3 << 29),
        ("64KiB", 64 << 10),
        ("64 KiB", 64 << 10),
        ("10MB", 10_000_000),
        ("10mb", 10_000_000),
        ("2Gi", 2 << 30),
        ("1k", 1000),
        ("1073741824", 1 << 30),
        ("  42  ", 42),
        ("7B", 7),
        ("0", 0),
        (".5KiB", 512),
        (4096, 4096),
        (0, 0),
        (4e9, 4_000_000_000),
        (float(1 << 40), 1 << 40),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12x", "", "GiB", "1.2.3MiB", "one", "1 G i B", "0x10"])
def test_parse_size_rejects_garbage_and_names_text(text: str) -> None:
    with pytest.raises(ConfigError, match="not a size") as info:
        parse_size(text, what="agent.host_bytes")
    assert f"agent.host_bytes={text!r}" in str(info.value)


@pytest.mark.parametrize("text", ["-1", "-1GiB", -5])
def test_parse_size_rejects_negative(text: str | int) -> None:
    with pytest.raises(ConfigError, match="negative") as info:
        parse_size(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("value", [True, None, [1], float("inf"), float("nan")])
def test_parse_size_rejects_other_types(value: object) -> None:
    with pytest.raises(ConfigError, match="not a size"):
        parse_size(value)  # type: ignore[arg-type]


def test_parse_size_rejects_a_fractional_float() -> None:
    with pytest.raises(ConfigError, match=r"host_bytes=1\.5: not a whole number of bytes"):
        parse_size(1.5, what="host_bytes")


@pytest.mark.parametrize("value", ["16EiB", 1.5e300, float(1 << 63)])
def test_parse_size_rejects_beyond_int64(value: str | float) -> None:
    with pytest.raises(ConfigError, match=f"larger than the limit of {(1 << 63) - 1} B") as info:
        parse_size(value, what="host_bytes")
    assert f"host_bytes={value!r}" in str(info.value)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (512 << 20, "512.0 MiB"),
        ((1 << 20) - 1, "1.0 MiB"),
        (3 << 29, "1.5 GiB"),
        (1 << 40, "1.0 TiB"),
    ],
)
def test_format_size(size: int, expected: str) -> None:
    assert format_size(size) == expected


def test_format_parse_round_trip() -> None:
    for size in (1 << 10, 3 << 20, 5 << 30):
        assert parse_size(format_size(size).replace(" ", "")) == size


def test_split_host_port() -> None:
    assert split_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_host_port("[::1]:6379") == ("::1", 6379)
    for bad in ("nohost", ":80", "h:65536", "h:x", "::1:80"):
        with pytest.raises(ConfigError, match=repr(bad).replace("[", r"\[")):
            split_host_port(bad)


# --- precedence -------------------------------------------------------------------------------------


def test_defaults_with_empty_environment() -> None:
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.redis_url is None
    assert cfg.client.transports == ("shm", "tcp")
    assert cfg.agent.host_bytes == 1 << 30


def test_precedence_defaults_file_env_overrides(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        """
        namespace = "from-file"
        redis_url = "redis://file:6379/0"
        [client]
        timeout_s = 3
        lease_ms = 1000
        tcp_connections = 2
        [agent]
        host_bytes = "2GiB"
        zone = "file-zone"
        listen = "0.0.0.0:7000"
        """,
    )
    env = {
        "MOONCAKE_NAMESPACE": "from-env",
        "MOONCAKE_CLIENT_LEASE_MS": "2000",
        "MOONCAKE_CLIENT_TCP_CONNECTIONS": "8",
        "MOONCAKE_AGENT_HOST_BYTES": "3GiB",
    }
    overrides: dict[str, object] = {
        "client.tcp_connections": 16,
        "agent.host_bytes": "4GiB",
        "redis_url": None,  # not given: the file's value stands
    }
    cfg = load_config(file=path, env=env, overrides=overrides)
    assert cfg.redis_url == "redis://file:6379/0"  # file only
    assert cfg.namespace == "from-env"  # env beats file
    assert cfg.client.timeout_s == 3.0  # file beats default
    assert isinstance(cfg.client.timeout_s, float)
    assert cfg.client.lease_ms == 2000  # env beats file
    assert cfg.client.tcp_connections == 16  # override beats env and file
    assert cfg.agent.host_bytes == 4 << 30  # override beats env and file
    assert cfg.agent.zone == "file-zone"
    assert cfg.agent.listen == "0.0.0.0:7000"
    assert cfg.client.io_threads == ClientConfig().io_threads  # default where nobody set it


def test_file_from_mooncake_config_env(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'namespace = "via-env-var"\n')
    cfg = load_config(env={"MOONCAKE_CONFIG": str(path)})
    assert cfg.namespace == "via-env-var"


def test_explicit_file_beats_mooncake_config(tmp_path: Path) -> None:
    a = tmp_path / "a.toml"
    a.write_text('namespace = "a"\n')
    b = tmp_path / "b.toml"
    b.write_text('namespace = "b"\n')
    assert load_config(file=a, env={"MOONCAKE_CONFIG": str(b)}).namespace == "a"


def test_default_file_location_follows_home(tmp_path: Path) -> None:
    conf_dir = tmp_path / ".config" / "mooncake"
    conf_dir.mkdir(parents=True)
    (conf_dir / "config.toml").write_text('namespace = "home"\n')
    assert load_config(env={"HOME": str(tmp_path)}).namespace == "home"
    # No file there: defaults, no error.
    assert load_config(env={"HOME": str(tmp_path / "elsewhere")}).namespace == "default"


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in [v for v in os.environ if v.startswith("MOONCAKE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("MOONCAKE_AGENT_ZONE", "rack-7")
    monkeypatch.setenv("MOONCAKE_CLIENT_VERIFY_CHECKSUM", "yes")
    cfg = load_config()
    assert cfg.agent.zone == "rack-7"
    assert cfg.client.verify_checksum is True


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("False", False), ("no", False)],
)
def test_bool_coercion(text: str, expected: bool) -> None:
    assert load_config(env={"MOONCAKE_AGENT_PREFAULT": text}).agent.prefault is expected


def test_tuple_coercion_from_env_and_file(tmp_path: Path) -> None:
    cfg = load_config(env={"MOONCAKE_CLIENT_TRANSPORTS": " tcp , rdma "})
    assert cfg.client.transports == ("tcp", "rdma")
    path = write_toml(tmp_path, '[client]\ntransports = ["rdma", "shm"]\n')
    assert load_config(file=path, env={}).client.transports == ("rdma", "shm")


def test_overrides_accept_typed_values_and_cli_spelling() -> None:
    cfg = load_config(env={}, overrides={"agent.host-bytes": 1 << 20, "client.verify_checksum": True})
    assert cfg.agent.host_bytes == 1 << 20
    assert cfg.client.verify_checksum is True


def test_empty_redis_url_env_means_unset(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'redis_url = "redis://h:1/0"\n')
    assert load_config(file=path, env={"MOONCAKE_REDIS_URL": ""}).redis_url is None


def test_non_config_env_vars_are_ignored() -> None:
    env = {"MOONCAKE_REDIS_SERVER": "/nonexistent", "MOONCAKE_STATE_DIR": "/tmp/x", "OTHER": "1"}
    assert load_config(env=env) == Config()


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "rediss://user:pw@host:6380/2", "unix:///run/redis.sock", "redis://h"]
)
def test_valid_redis_urls(url: str) -> None:
    assert load_config(env={}, overrides={"redis_url": url}).redis_url == url


# --- errors: key, value and source in every message --------------------------------------------------


@pytest.mark.parametrize(
    ("var", "value", "fragment"),
    [
        ("MOONCAKE_AGENT_HOST_BYTES", "12x", "not a size (examples: 512MiB, 1GiB, 1073741824)"),
        ("MOONCAKE_AGENT_HOST_BYTES", "-1GiB", "negative"),
        ("MOONCAKE_AGENT_HOST_BYTES", "0", "must be between"),
        ("MOONCAKE_CLIENT_STRIPE_BYTES", "0", "must be between"),
        ("MOONCAKE_CLIENT_TIMEOUT_S", "fast", "not a number"),
        ("MOONCAKE_CLIENT_TIMEOUT_S", "0", "must be > 0 s"),
        ("MOONCAKE_CLIENT_TIMEOUT_S", "-3", "must be > 0 s"),
        ("MOONCAKE_CLIENT_TIMEOUT_S", "nan", "not a finite number"),
        ("MOONCAKE_CLIENT_LEASE_MS", "5.5", "not an integer"),
        ("MOONCAKE_CLIENT_LEASE_MS", "0", "must be >= 1 ms"),
        ("MOONCAKE_CLIENT_TCP_CONNECTIONS", "65", "<= 64"),
        ("MOONCAKE_CLIENT_TCP_CONNECTIONS", "0", ">= 1"),
        ("MOONCAKE_CLIENT_MAX_RETRIES", "-1", ">= 0"),
        ("MOONCAKE_CLIENT_IO_THREADS", "0", ">= 1"),
        ("MOONCAKE_CLIENT_VERIFY_CHECKSUM", "maybe", "not a boolean"),
        ("MOONCAKE_CLIENT_TRANSPORTS", "shm,carrier-pigeon", "unknown transport 'carrier-pigeon'"),
        ("MOONCAKE_CLIENT_TRANSPORTS", "tcp,tcp", "more than once"),
        ("MOONCAKE_CLIENT_TRANSPORTS", " , ", "at least one"),
        ("MOONCAKE_AGENT_LISTEN", "localhost", "HOST:PORT"),
        ("MOONCAKE_AGENT_LISTEN", "127.0.0.1:70000", "not in 0..65535"),
        ("MOONCAKE_AGENT_ZONE", "rack 7", "zone must be"),
        ("MOONCAKE_AGENT_NODE_ID", "a/b", "node_id must be"),
        # A node's disk directory is disk_path/node_id: ".." put it beside disk_path and cleared files there.
        ("MOONCAKE_AGENT_NODE_ID", "..", "node_id cannot be '..'"),
        ("MOONCAKE_AGENT_NODE_ID", ".", "node_id cannot be '.'"),
        ("MOONCAKE_NAMESPACE", "..", "namespace cannot be '..'"),
        ("MOONCAKE_NAMESPACE", "x" * 65, "namespace must be"),
        ("MOONCAKE_REDIS_URL", "http://localhost:6379", "redis://, rediss:// or unix://"),
        ("MOONCAKE_REDIS_URL", "redis://h:99999/0", "port must be 1..65535, got 99999"),
        ("MOONCAKE_REDIS_URL", "redis://h:port/0", "not a valid URL"),
        ("MOONCAKE_REDIS_URL", "redis://h:6379/zero", "must be a number"),
        ("MOONCAKE_REDIS_URL", "unix://", "socket path"),
    ],
)
def test_bad_env_value_names_var_value_and_problem(var: str, value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={var: value})
    message = str(info.value)
    assert message.startswith(f"env {var}={value!r}: "), message
    assert fragment in message


def test_env_error_matches_documented_example() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"MOONCAKE_AGENT_HOST_BYTES": "12x"})
    assert str(info.value) == ("env MOONCAKE_AGENT_HOST_BYTES='12x': not a size (examples: 512MiB, 1GiB, 1073741824)")


def test_redis_url_password_is_redacted_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"MOONCAKE_REDIS_URL": "http://user:hunter2@host:1"})
    assert "hunter2" not in str(info.value)
    assert "user:***@host:1" in str(info.value)


@pytest.mark.parametrize(
    ("toml", "key", "fragment"),
    [
        ("[agent]\nhost_bytes = 1.5\n", "agent.host_bytes", "not a whole number of bytes"),
        ("[agent]\nhost_bytes = true\n", "agent.host_bytes", "not a size"),
        ("[client]\nlease_ms = 5000.0\n", "client.lease_ms", "not an integer"),
        ("[client]\ntimeout_s = true\n", "client.timeout_s", "not a number"),
        ("[client]\ntransports = [1, 2]\n", "client.transports", "list of strings"),
        ("[client]\nverify_checksum = 2\n", "client.verify_checksum", "not a boolean"),
        ("namespace = 5\n", "namespace", "expected text"),
        ("[agent]\nheartbeat_interval_s = 5\nheartbeat_ttl_s = 5\n", "agent.heartbeat_ttl_s", "greater than"),
    ],
)
def test_bad_file_value_names_file_key_and_value(tmp_path: Path, toml: str, key: str, fragment: str) -> None:
    path = write_toml(tmp_path, toml)
    with pytest.raises(ConfigError) as info:
        load_config(file=path, env={})
    message = str(info.value)
    assert message.startswith(f"file {path}: {key}="), message
    assert fragment in message


def test_bad_override_names_key_and_value() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"client.tcp_connections": "lots"})
    assert str(info.value) == "override client.tcp_connections='lots': not an integer"


def test_a_ttl_below_the_default_interval_takes_the_interval_down_with_it() -> None:
    """`--heartbeat-ttl-s 1` (or 0.5) with no interval given was refused, blaming the 1 s default
    interval the user never set; the interval is now a third of such a TTL."""
    config = load_config(env={"MOONCAKE_AGENT_HEARTBEAT_TTL_S": "0.5"})
    assert config.agent.heartbeat_ttl_s == 0.5 and config.agent.heartbeat_interval_s == pytest.approx(0.5 / 3)
    assert load_config(env={}, overrides={"agent.heartbeat_ttl_s": 1.5}).agent.heartbeat_interval_s == 1.0
    with pytest.raises(ConfigError, match=r"greater than agent\.heartbeat_interval_s=1\.0"):  # one given: as it is
        load_config(env={"MOONCAKE_AGENT_HEARTBEAT_TTL_S": "0.5", "MOONCAKE_AGENT_HEARTBEAT_INTERVAL_S": "1.0"})


def test_cross_field_error_names_both_sources(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[agent]\nheartbeat_interval_s = 2.0\n")
    with pytest.raises(ConfigError) as info:
        load_config(file=path, env={"MOONCAKE_AGENT_HEARTBEAT_TTL_S": "1.5"})
    message = str(info.value)
    assert message.startswith("env MOONCAKE_AGENT_HEARTBEAT_TTL_S='1.5': ")
    assert f"heartbeat_interval_s=2.0 (from file {path})" in message


def test_unknown_key_in_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[agent]\nhots_bytes = 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(file=path, env={})
    assert str(info.value).startswith(f"file {path}: unknown key agent.hots_bytes")
    assert "did you mean agent.host_bytes?" in str(info.value)


@pytest.mark.parametrize(
    ("toml", "fragment"),
    [
        ("redis = 1\n", "unknown key redis"),
        ("[server]\nport = 1\n", "unknown key server"),
        ("[client]\nredis_url = 'redis://h'\n", "unknown key client.redis_url"),
        ("client = 5\n", "expected a table [client]"),
        ("[agent\n", "not valid TOML"),
        # tomllib reads nesting by recursion: these were "internal error: RecursionError", exit 1.
        ("x = " + "[" * 5000 + "]" * 5000 + "\n", "not valid TOML (arrays or tables nested too deep to read)"),
        ("x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n", "not valid TOML (arrays or tables nested too deep"),
    ],
)
def test_bad_file_structure(tmp_path: Path, toml: str, fragment: str) -> None:
    path = write_toml(tmp_path, toml)
    with pytest.raises(ConfigError) as info:
        load_config(file=path, env={})
    assert str(info.value).startswith(f"file {path}: ")
    assert fragment in str(info.value)


def test_unknown_env_var() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"MOONCAKE_AGENT_HOTS_BYTES": "1GiB"})
    message = str(info.value)
    assert message.startswith("env MOONCAKE_AGENT_HOTS_BYTES: unknown variable")
    assert "did you mean MOONCAKE_AGENT_HOST_BYTES?" in message


def test_unknown_override_key() -> None:
    with pytest.raises(ConfigError, match=r"^override: unknown key agent\.hots_bytes"):
        load_config(env={}, overrides={"agent.hots_bytes": "1GiB"})


def test_missing_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"file {missing}: does not exist"):
        load_config(file=missing, env={})
    with pytest.raises(ConfigError, match=r"env MOONCAKE_CONFIG=.*nope\.toml.*does not exist"):
        load_config(env={"MOONCAKE_CONFIG": str(missing)})


# --- dataclasses built in code -------------------------------------------------------------------------


def test_dataclasses_are_frozen_and_validate_in_code() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.namespace = "x"  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"client\.tcp_connections=0: must be >= 1"):
        ClientConfig(tcp_connections=0)
    with pytest.raises(ConfigError, match=r"client\.lease_ms='5': expected int"):
        ClientConfig(lease_ms="5")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="greater than"):
        AgentConfig(heartbeat_interval_s=3.0, heartbeat_ttl_s=2.0)
    with pytest.raises(ConfigError, match="redis_url"):
        Config(redis_url="http://x")
    with pytest.raises(ConfigError, match="expected a ClientConfig"):
        Config(client=AgentConfig())  # type: ignore[arg-type]
    assert ClientConfig(timeout_s=2).timeout_s == 2


def test_as_dict_redacts_password() -> None:
    cfg = Config(redis_url="redis://:secret@h:6379/0")
    assert cfg.as_dict()["redis_url"] == "redis://:***@h:6379/0"
    assert cfg.as_dict()["agent"]["host_bytes"] == 1 << 30


@pytest.mark.parametrize("size", ["1", "100", "65535"])
def test_an_arena_smaller_than_64_kib_is_refused(size: str) -> None:
    """`--host-bytes 1` started an agent whose every put waited out its timeout and then said
    "need 65 B ... 100/100 B free": the 64 B allocation unit showed through."""
    with pytest.raises(ConfigError, match=f"agent.host_bytes='{size}': must be between 64.0 KiB"):
        load_config(env={}, overrides={"agent.host_bytes": size})
    assert load_config(env={}, overrides={"agent.host_bytes": "64KiB"}).agent.host_bytes == 64 << 10


@pytest.mark.parametrize("size", ["12XB", 0])
def test_a_local_cluster_with_a_bad_arena_size_is_refused_before_it_starts(size: str | int) -> None:
    """It started its server, then reported an agent that "did not become ready within 30 s"."""
    from mooncake_store import LocalCluster

    with pytest.raises(ConfigError, match=r"agent\.host_bytes"):
        LocalCluster(1, host_bytes=size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:5/0?password=s3cret", "redis://127.0.0.1:5/0?password=***"),
        (
            "redis://h:1/0?db=1&PASSWORD=s3cret&ssl_password=s3cret#f",
            "redis://h:1/0?db=1&PASSWORD=***&ssl_password=***#f",
        ),
        ("redis://u:s3cret@h:1/0?password=s3cret", "redis://u:***@h:1/0?password=***"),
        ("redis://:s3cret@[::1/0", "redis://***@[::1/0"),  # does not parse: all before the @ hidden
        ("redis://h:1/0", "redis://h:1/0"),
        ("redis://user@h:1/0", "redis://user@h:1/0"),  # a user name alone is no secret
        # Parsed, but with no host: a mistyped scheme or a missing slash was shown whole.
        ("red is://u:s3cret@x", "***@x"),
        ("redis:/u:s3cret@h:6379/0", "***@h:6379/0"),
        ("redis//:s3cret@h:6379/0", "***@h:6379/0"),
        (":s3cret@h:6379", "***@h:6379"),
        ("redis:://u:s3cret@h", "***@h"),
        # A "/", "?" or "#" in a password ends urlsplit's host part early: the "@" is in the path.
        ("redis://:s3/cret@h:6379/0", "redis://***@h:6379/0"),
        ("redis://u:s3#cret@h:6379/0", "redis://***@h:6379/0"),
        ("redis://h:6379/0?client_name=a@b", "redis://h:6379/0?client_name=a@b"),  # parses: no secret
        # A password starting with digits reads as a port: host "admin", port 2024, and the URL parsed.
        ("redis://admin:2024#s3cret@db:6379", "redis://***@db:6379"),
        ("redis://admin:8080?s3cret@db:6379/0", "redis://***@db:6379/0"),
        ("redis://admin:443/s3cret@db:6379", "redis://***@db:6379"),
    ],
)
def test_every_password_redis_py_reads_in_a_url_is_redacted(url: str, shown: str) -> None:
    """redis-py takes a password from the query as well (``?password=``); those were printed as
    given, by `mooncake stat --json`, `doctor` and every connection error. A URL that did not
    parse was returned whole, password and all."""
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3/cret@h:6379/0",
        "redis://u:s3#cret@h:6379/0",
        "redis://u:s3?cret@h:6379/0",
        # Digits first: read as a port, and the URL accepted (host "u") or its "database" quoted.
        "redis://u:2024#s3cret@h:6379",
        "redis://u:8080?s3cret@h:6379/0",
        "redis://u:443/s3cret@h:6379",
    ],
)
def test_a_password_with_an_unencoded_delimiter_is_named_as_such_and_never_shown(url: str) -> None:
    """Such a URL was refused as "needs a host" or "port must be 1..65535, got 6379" (a valid
    port), with the password in the message: urlsplit ends the host part at the delimiter."""
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"redis_url": url}, override_flags={"redis_url": "--redis-url"})
    message = str(info.value)
    assert "must be percent-encoded" in message and "got 6379" not in message, message
    assert "s3" not in message and "cret" not in message, message


def test_a_url_with_a_lone_bracket_is_not_called_a_bad_port() -> None:
    """``redis://:pw@[::1/0`` was refused as "port must be 1..65535, got 1" (read out of "[::1")."""
    with pytest.raises(ConfigError) as info:
        load_config(env={"MOONCAKE_REDIS_URL": "redis://:s3cret@[::1/0"})
    assert "not a valid URL" in str(info.value) and "port" not in str(info.value)
    assert "s3cret" not in str(info.value)
