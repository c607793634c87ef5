"""The config tree (frozen dataclasses), the table of its fields and the checks on every value."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from mooncake_store.config.values import (
    _FALSE,
    _MAX_SIZE,
    _NAME_RE,
    _SIZE_EXAMPLES,
    _TRUE,
    CONFIG_TRANSPORTS,
    ENV_PREFIX,
    _parse_host_port,
    format_size,
    parse_size,
    redact_url,
)
from mooncake_store.errors import ConfigError

# --- the tree ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    transports: tuple[str, ...] = ("shm", "tcp")  # subset of CONFIG_TRANSPORTS, tried in this order
    timeout_s: float = 10.0  # every socket operation and wait
    lease_ms: int = 5000  # read lease granted by a lookup
    tcp_connections: int = 4  # connections per peer for large objects
    stripe_bytes: int = 4 << 20  # objects above this are split across connections
    io_threads: int = 8  # runs the futures of get_async/put_async
    max_retries: int = 3
    verify_checksum: bool = False

    def __post_init__(self) -> None:
        _validate_instance(self, "client")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    node_id: str = ""  # "" -> derived at start
    host_bytes: int = 1 << 30
    listen: str = "127.0.0.1:0"  # HOST:PORT of the TCP transport
    advertise: str = ""  # HOST:PORT peers should dial ("" -> the bound address of listen)
    zone: str = "default"
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0  # must exceed heartbeat_interval_s
    reserve_timeout_s: float = 30.0  # reservations never committed are reclaimed after this
    sync_interval_s: float = 0.2
    prefault: bool = True
    # Memory pressure: past high_watermark of a tier's capacity the agent moves its coldest
    # objects (demote to its next tier, else spill to a peer, else evict) until under low_watermark.
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    pressure_interval_s: float = 0.2
    spill_to_peers: bool = True
    disk_path: str = ""  # "" -> no disk tier
    disk_bytes: int = 0  # capacity of the disk tier (compressed bytes on disk)
    promote_on_read: bool = True  # a read of a disk replica brings the object back to host memory
    gpu_bytes: int = 0  # 0 -> no GPU tier
    gpu_id: int = 0

    def __post_init__(self) -> None:
        _validate_instance(self, "agent")


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    redis_url: str | None = None  # redis://, rediss:// or unix://; None -> an embedded server
    namespace: str = "default"  # prefix of every Redis key, so deployments can share one server
    client: ClientConfig = field(default_factory=ClientConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.client, ClientConfig):
            raise ConfigError(f"client={self.client!r}: expected a ClientConfig")
        if not isinstance(self.agent, AgentConfig):
            raise ConfigError(f"agent={self.agent!r}: expected an AgentConfig")
        _validate_instance(self, None)

    def as_dict(self) -> dict[str, Any]:
        """Plain nested dict (password redacted), for ``config show`` and logs."""
        out = asdict(self)
        if self.redis_url is not None:
            out["redis_url"] = redact_url(self.redis_url)
        return out


# --- field table ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Field:
    key: str  # dotted: "redis_url", "agent.host_bytes"
    section: str | None
    name: str
    kind: str  # str, optstr, int, size, float, bool, tuple
    env_var: str


@dataclass(frozen=True, slots=True, kw_only=True)
class _Source:
    kind: str  # default, code, file, env, override
    detail: str = ""  # the file path or the env var name

    def label(self, key: str) -> str:
        """Prefix of an error message: where the value came from and which key it was for."""
        if self.kind == "env":
            return f"env {self.detail}"
        if self.kind == "file":
            return f"file {self.detail}: {key}"
        if self.kind == "override":
            return f"override {key}"
        return key

    def describe(self) -> str:
        if self.kind == "env":
            return f"env {self.detail}"
        if self.kind == "file":
            return f"file {self.detail}"
        return self.kind


_DEFAULT = _Source(kind="default")
_CODE = _Source(kind="code")

_KIND_BY_ANNOTATION = {
    "str": "str",
    "str | None": "optstr",
    "int": "int",
    "float": "float",
    "bool": "bool",
    "tuple[str, ...]": "tuple",
}


def _build_fields() -> dict[str, _Field]:
    table: dict[str, _Field] = {}
    sections: tuple[tuple[str | None, type], ...] = (
        (None, Config),
        ("client", ClientConfig),
        ("agent", AgentConfig),
    )
    for section, cls in sections:
        for f in fields(cls):
            if f.name in ("client", "agent"):
                continue
            # Annotations are strings under `from __future__ import annotations`; the table maps them.
            kind = _KIND_BY_ANNOTATION[str(f.type)]
            if kind == "int" and f.name.endswith("_bytes"):
                kind = "size"
            key = f.name if section is None else f"{section}.{f.name}"
            env_var = ENV_PREFIX + key.replace(".", "_").upper()
            table[key] = _Field(key=key, section=section, name=f.name, kind=kind, env_var=env_var)
    return table


# --- validators: return a problem (the value is already in the message prefix) or None ---------------

_Check = Callable[[Any], str | None]


def _number_range(lo: float, hi: float, *, lo_open: bool = False, unit: str = "") -> _Check:
    def check(value: Any) -> str | None:
        below = value <= lo if lo_open else value < lo
        if below or value > hi:
            low = f"> {lo:g}{unit}" if lo_open else f">= {lo:g}{unit}"
            return f"must be {low} and <= {hi:g}{unit}"
        return None

    return check


def _size_range(lo: int, hi: int = _MAX_SIZE) -> _Check:
    def check(value: int) -> str | None:
        if not lo <= value <= hi:
            return f"must be between {format_size(lo)} and {format_size(hi)} ({lo}..{hi} B)"
        return None

    return check


def _check_name(what: str, *, allow_empty: bool = False) -> _Check:
    def check(value: str) -> str | None:
        if allow_empty and value == "":
            return None
        if not _NAME_RE.fullmatch(value):
            return f"{what} must be 1..64 characters of A-Z a-z 0-9 _ . -"
        return None

    return check


def _check_redis_url(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        parts = urlsplit(value)
        scheme = parts.scheme.lower()
        if scheme not in ("redis", "rediss", "unix"):
            return "scheme must be redis://, rediss:// or unix://, e.g. redis://127.0.0.1:6379/0"
        if scheme == "unix":
            return None if parts.path else "unix:// needs a socket path, e.g. unix:///run/redis.sock"
        if not parts.hostname:
            return "needs a host, e.g. redis://127.0.0.1:6379/0"
        _ = parts.port  # raises ValueError when out of range or not a number
    except ValueError as exc:
        return f"not a valid URL ({exc})"
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        return f"database {db!r} must be a number, e.g. redis://127.0.0.1:6379/0"
    return None


def _check_transports(value: tuple[str, ...]) -> str | None:
    if not value:
        return f"must name at least one of {', '.join(CONFIG_TRANSPORTS)}"
    unknown = [t for t in value if t not in CONFIG_TRANSPORTS]
    if unknown:
        return f"unknown transport {unknown[0]!r}; choose from {', '.join(CONFIG_TRANSPORTS)}"
    if len(set(value)) != len(value):
        return "names a transport more than once"
    return None


def _check_listen(value: str) -> str | None:
    result = _parse_host_port(value)
    return result if isinstance(result, str) else None


_DAY_S = 86400.0
_CHECKS: dict[str, _Check] = {
    "redis_url": _check_redis_url,
    "namespace": _check_name("namespace"),
    "client.transports": _check_transports,
    "client.timeout_s": _number_range(0, _DAY_S, lo_open=True, unit=" s"),
    "client.lease_ms": _number_range(1, 3_600_000, unit=" ms"),
    "client.tcp_connections": _number_range(1, 64),
    "client.stripe_bytes": _size_range(1),
    "client.io_threads": _number_range(1, 1024),
    "client.max_retries": _number_range(0, 100),
    "agent.node_id": _check_name("node_id", allow_empty=True),
    "agent.host_bytes": _size_range(1),
    "agent.listen": _check_listen,
    "agent.advertise": lambda v: None if v == "" else _check_listen(v),
    "agent.zone": _check_name("zone"),
    "agent.heartbeat_interval_s": _number_range(0, 3600, lo_open=True, unit=" s"),
    "agent.heartbeat_ttl_s": _number_range(0, _DAY_S, lo_open=True, unit=" s"),
    "agent.reserve_timeout_s": _number_range(0, _DAY_S, lo_open=True, unit=" s"),
    "agent.sync_interval_s": _number_range(0, 3600, lo_open=True, unit=" s"),
    "agent.high_watermark": _number_range(0, 1, lo_open=True),
    "agent.low_watermark": _number_range(0, 1),
    "agent.pressure_interval_s": _number_range(0, 3600, lo_open=True, unit=" s"),
    "agent.disk_bytes": _size_range(0),
    "agent.gpu_bytes": _size_range(0),
    "agent.gpu_id": _number_range(0, 1023),
}


def _show(spec: _Field, value: object) -> str:
    if spec.kind == "optstr" and isinstance(value, str):
        return repr(redact_url(value))
    return repr(value)


def _fail(spec: _Field, value: object, source: _Source, problem: str) -> ConfigError:
    return ConfigError(f"{source.label(spec.key)}={_show(spec, value)}: {problem}")


def _coerce(spec: _Field, value: object, source: _Source) -> object:
    """``value`` (a string from env or CLI, or a TOML value) as the field's type."""
    kind = spec.kind
    if kind == "size":
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise _fail(spec, value, source, f"not a size ({_SIZE_EXAMPLES})")
        return parse_size(value, what=source.label(spec.key))
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip(), 10)
            except ValueError:
                pass
        raise _fail(spec, value, source, "not an integer")
    if kind == "float":
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        if number is None:
            raise _fail(spec, value, source, "not a number")
        if not math.isfinite(number):
            raise _fail(spec, value, source, "not a finite number")
        return number
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise _fail(spec, value, source, "not a boolean (use true/false, yes/no, on/off or 1/0)")
    if kind == "tuple":
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise _fail(spec, value, source, "expected a list of strings or comma-separated text")
    if kind == "optstr":
        if value is None or value == "":
            return None  # MOONCAKE_REDIS_URL= (empty) means "not set", as in most tools
        if isinstance(value, str):
            return value
        raise _fail(spec, value, source, "expected text")
    if isinstance(value, str):
        return value
    raise _fail(spec, value, source, "expected text")


def _check(spec: _Field, value: object, source: _Source) -> object:
    typed = _coerce(spec, value, source)
    checker = _CHECKS.get(spec.key)
    problem = checker(typed) if checker else None
    if problem:
        raise _fail(spec, value, source, problem)
    return typed


_KIND_NAMES = {
    "str": "str",
    "optstr": "str or None",
    "int": "int",
    "size": "int (bytes)",
    "float": "float",
    "bool": "bool",
    "tuple": "tuple of str",
}


def _type_ok(kind: str, value: object) -> bool:
    if isinstance(value, bool):
        return kind == "bool"
    if kind in ("int", "size"):
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, int | float)
    if kind == "bool":
        return False
    if kind == "tuple":
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if kind == "optstr":
        return value is None or isinstance(value, str)
    return isinstance(value, str)


def _validate_instance(obj: object, section: str | None) -> None:
    """Checks for dataclasses built in code (tests, embedding apps): strict types, same ranges."""
    for f in fields(obj):  # type: ignore[arg-type]
        spec = _FIELDS.get(f.name if section is None else f"{section}.{f.name}")
        if spec is None:
            continue  # the nested client/agent sections validate themselves
        value = getattr(obj, f.name)
        if not _type_ok(spec.kind, value):
            wanted = _KIND_NAMES[spec.kind]
            raise _fail(spec, value, _CODE, f"expected {wanted}, got {type(value).__name__}")
        if spec.kind == "optstr" and value == "":
            raise _fail(spec, value, _CODE, "use None, not an empty string, for no URL")
        _check(spec, value, _CODE)
    if section == "agent":
        assert isinstance(obj, AgentConfig)
        _check_heartbeat(obj.heartbeat_interval_s, obj.heartbeat_ttl_s, _CODE, _CODE)
        _check_watermarks(obj.low_watermark, obj.high_watermark, _CODE)
        if obj.disk_bytes and not obj.disk_path:
            raise ConfigError(
                f"agent.disk_bytes={obj.disk_bytes} needs agent.disk_path (the directory of the disk tier)"
            )


def _check_watermarks(low: float, high: float, source: _Source) -> None:
    # With low >= high the agent would start moving objects and never reach its stopping point.
    if low >= high:
        raise _fail(_FIELDS["agent.low_watermark"], low, source, f"must be below agent.high_watermark={high!r}")


def _check_heartbeat(
    interval: float, ttl: float, interval_src: _Source, ttl_src: _Source, *, ttl_as_given: object = None
) -> None:
    """``ttl_as_given`` is the TTL as the user wrote it, so the message quotes their text."""
    # A TTL at or below the interval lets a healthy node's entry expire between two heartbeats.
    if ttl <= interval:
        spec = _FIELDS["agent.heartbeat_ttl_s"]
        raise _fail(
            spec,
            ttl if ttl_as_given is None else ttl_as_given,
            ttl_src,
            f"must be greater than agent.heartbeat_interval_s={interval!r} (from {interval_src.describe()})",
        )


_FIELDS: dict[str, _Field] = _build_fields()
_FIELDS_BY_ENV: dict[str, _Field] = {spec.env_var: spec for spec in _FIELDS.values()}
