"""One configuration tree for the client and the agent, loaded once per process.

Layers, lowest to highest precedence::

    defaults  <  TOML file  <  MOONCAKE_* environment  <  explicit overrides (CLI flags)

The file is ``file=`` if given, else ``$MOONCAKE_CONFIG``, else ``$XDG_CONFIG_HOME/mooncake/config.toml``
(``~/.config/mooncake/config.toml``) when it exists. Its layout::

    redis_url = "redis://127.0.0.1:6379/0"
    namespace = "default"
    [client]
    timeout_s = 10.0
    [agent]
    host_bytes = "4GiB"

Environment variables are ``MOONCAKE_REDIS_URL``, ``MOONCAKE_NAMESPACE``, ``MOONCAKE_CLIENT_<FIELD>`` and
``MOONCAKE_AGENT_<FIELD>``. Overrides use dotted keys (``{"agent.host_bytes": "1GiB"}``).

Every mistake raises :class:`ConfigError` naming the key, the bad value and the layer it came from, e.g.
``env MOONCAKE_AGENT_HOST_BYTES='12x': not a size (examples: 512MiB, 1GiB, 1073741824)``. A typo must
never be silently ignored: a misspelt ``host_bytes`` would otherwise leave an agent with the 1 GiB default.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from mooncake_store.errors import ConfigError

ENV_PREFIX = "MOONCAKE_"

#: ``MOONCAKE_*`` variables that are read elsewhere and are not config keys. Any other ``MOONCAKE_*``
#: variable that matches no key is an error, because it is almost always a misspelt key.
NON_CONFIG_ENV_VARS: frozenset[str] = frozenset({"MOONCAKE_CONFIG", "MOONCAKE_REDIS_SERVER", "MOONCAKE_STATE_DIR"})

#: Transports a client may be configured with (``inproc`` is implicit: it is always tried first).
CONFIG_TRANSPORTS: tuple[str, ...] = ("shm", "tcp", "rdma")

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SIZE_RE = re.compile(r"(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)", re.IGNORECASE)
_SIZE_EXAMPLES = "examples: 512MiB, 1GiB, 1073741824"
# "i" means binary, everything else decimal, as in IEC and Kubernetes; so "10MB" is 10**7 bytes.
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{f"{p}": 1000**e for e, p in enumerate("kmgtpe", start=1)},
    **{f"{p}b": 1000**e for e, p in enumerate("kmgtpe", start=1)},
    **{f"{p}i": 1024**e for e, p in enumerate("kmgtpe", start=1)},
    **{f"{p}ib": 1024**e for e, p in enumerate("kmgtpe", start=1)},
}
# Sizes travel as signed 64-bit integers (Redis integers, struct "q" in frames).
_MAX_SIZE = (1 << 63) - 1
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Bytes in ``text``: ``"512MiB"``, ``"1.5GiB"``, ``"10MB"`` (decimal), ``"1073741824"`` or an int.

    Units are case-insensitive; a fractional result is rounded down to whole bytes. ``what`` prefixes
    the error message, so callers pass the key and layer the value came from.
    """
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ConfigError(f"{what}={text!r}: not a size ({_SIZE_EXAMPLES})")
    if isinstance(text, int):
        number = Decimal(text)
    else:
        stripped = text.strip()
        if stripped.startswith("-"):
            raise ConfigError(f"{what}={text!r}: a size cannot be negative")
        match = _SIZE_RE.fullmatch(stripped)
        unit = _SIZE_UNITS.get(match.group("unit").lower()) if match else None
        if match is None or unit is None:
            raise ConfigError(f"{what}={text!r}: not a size ({_SIZE_EXAMPLES})")
        try:
            number = Decimal(match.group("num")) * unit
        except InvalidOperation:  # pragma: no cover - the regex admits only plain decimals
            raise ConfigError(f"{what}={text!r}: not a size ({_SIZE_EXAMPLES})") from None
    if number < 0:
        raise ConfigError(f"{what}={text!r}: a size cannot be negative")
    if number > _MAX_SIZE:
        raise ConfigError(f"{what}={text!r}: larger than the limit of {_MAX_SIZE} B")
    return int(number)


def format_size(size_bytes: int) -> str:
    """``"0 B"``, ``"1023 B"``, ``"512.0 MiB"``: binary units with one decimal, for messages and CLIs."""
    if abs(size_bytes) < 1024:
        return f"{size_bytes} B"
    value = float(size_bytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        value /= 1024
        # Compare the rounded value so 1048575 B reads "1.0 MiB", not "1024.0 KiB".
        if abs(round(value, 1)) < 1024 or unit == "EiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def split_host_port(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` or ``"[V6]:PORT"`` as ``(host, port)``; :class:`ConfigError` if malformed."""
    result = _parse_host_port(text)
    if isinstance(result, str):
        raise ConfigError(f"{text!r}: {result}")
    return result


def _parse_host_port(text: object) -> tuple[str, int] | str:
    """``(host, port)``, or the problem with ``text``."""
    if not isinstance(text, str):
        return "expected HOST:PORT text, e.g. 127.0.0.1:0"
    host, sep, port_text = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    # An unbracketed IPv6 address is ambiguous: is the last group the port or part of the address?
    if not sep or not host or (":" in host and not bracketed):
        return "expected HOST:PORT, e.g. 127.0.0.1:0 or [::1]:0"
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        return f"port {port_text!r} is not in 0..65535"
    return host, int(port_text)


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, so it can go into messages and logs."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rpartition("@")
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))
    except ValueError:
        return url


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
        raise _fail(
            _FIELDS["agent.low_watermark"], low, source, f"must be below agent.high_watermark={high!r}"
        )


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


# --- layers -----------------------------------------------------------------------------------------


def _unknown(where: str, name: str, candidates: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, candidates, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"{where}: unknown key {name}{hint}")


def _resolve_file(file: str | Path | None, env: Mapping[str, str]) -> tuple[Path | None, str]:
    """The config file to read, and how to name it in an error if it cannot be read."""
    if file is not None:
        path = Path(file).expanduser()
        if not path.is_file():
            raise ConfigError(f"file {path}: does not exist or is not a file")
        return path, f"file {path}"
    from_env = env.get("MOONCAKE_CONFIG", "")
    if from_env:
        path = Path(from_env).expanduser()
        if not path.is_file():
            raise ConfigError(f"env MOONCAKE_CONFIG={from_env!r}: file does not exist or is not a file")
        return path, f"file {path}"
    # The default location follows the given env mapping, not the process's, so that callers passing
    # an explicit env (tests) get a hermetic load.
    base = env.get("XDG_CONFIG_HOME") or (f"{env['HOME']}/.config" if env.get("HOME") else "")
    if base:
        path = Path(base) / "mooncake" / "config.toml"
        if path.is_file():
            return path, f"file {path}"
    return None, ""


def _read_file(path: Path) -> dict[str, tuple[object, _Source]]:
    source = _Source(kind="file", detail=str(path))
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"file {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"file {path}: not valid TOML ({exc})") from None
    found: dict[str, tuple[object, _Source]] = {}
    where = f"file {path}"
    for name, value in data.items():
        if name in ("client", "agent"):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {name}={value!r}: expected a table [{name}]")
            for sub, sub_value in value.items():
                key = f"{name}.{sub}"
                if key not in _FIELDS:
                    raise _unknown(where, key, list(_FIELDS))
                found[key] = (sub_value, source)
        elif name in _FIELDS:
            found[name] = (value, source)
        else:
            raise _unknown(where, name, [*_FIELDS, "client", "agent"])
    return found


def _read_env(env: Mapping[str, str]) -> dict[str, tuple[object, _Source]]:
    found: dict[str, tuple[object, _Source]] = {}
    for var in sorted(env):  # sorted: the same first error on every run
        if not var.startswith(ENV_PREFIX) or var in NON_CONFIG_ENV_VARS:
            continue
        spec = _FIELDS_BY_ENV.get(var)
        if spec is None:
            close = difflib.get_close_matches(var, list(_FIELDS_BY_ENV), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"env {var}: unknown variable{hint}; MOONCAKE_* variables must be config keys "
                f"or one of {', '.join(sorted(NON_CONFIG_ENV_VARS))}"
            )
        found[spec.key] = (env[var], _Source(kind="env", detail=var))
    return found


def _read_overrides(overrides: Mapping[str, object]) -> dict[str, tuple[object, _Source]]:
    found: dict[str, tuple[object, _Source]] = {}
    for raw_key, value in overrides.items():
        if value is None:
            continue  # an argparse flag that was not given
        key = raw_key.replace("-", "_")  # accept CLI spelling, agent.host-bytes
        if key not in _FIELDS:
            raise _unknown("override", raw_key, list(_FIELDS))
        found[key] = (value, _Source(kind="override"))
    return found


def load_config(
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Merge defaults < file < env < overrides into one validated :class:`Config`.

    ``env=None`` reads ``os.environ``; an override whose value is None counts as not given.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    layered: dict[str, tuple[object, _Source]] = {}
    path, _ = _resolve_file(file, environ)
    if path is not None:
        layered.update(_read_file(path))
    layered.update(_read_env(environ))
    layered.update(_read_overrides(overrides or {}))

    defaults = Config()
    values: dict[str, object] = {}
    sources: dict[str, _Source] = {}
    for key, spec in _FIELDS.items():
        if key in layered:
            raw, source = layered[key]
            values[key] = _check(spec, raw, source)
            sources[key] = source
        else:
            holder = defaults if spec.section is None else getattr(defaults, spec.section)
            values[key] = getattr(holder, spec.name)
            sources[key] = _DEFAULT
    # Checked here as well as in AgentConfig so the message can say where each of the two came from.
    _check_heartbeat(
        float(values["agent.heartbeat_interval_s"]),  # type: ignore[arg-type]
        float(values["agent.heartbeat_ttl_s"]),  # type: ignore[arg-type]
        sources["agent.heartbeat_interval_s"],
        sources["agent.heartbeat_ttl_s"],
        ttl_as_given=layered.get("agent.heartbeat_ttl_s", (None, _DEFAULT))[0],
    )

    _check_watermarks(
        float(values["agent.low_watermark"]),  # type: ignore[arg-type]
        float(values["agent.high_watermark"]),  # type: ignore[arg-type]
        sources["agent.low_watermark"],
    )

    def section(name: str | None) -> dict[str, Any]:
        return {spec.name: values[key] for key, spec in _FIELDS.items() if spec.section == name}

    return Config(
        **section(None),
        client=ClientConfig(**section("client")),
        agent=AgentConfig(**section("agent")),
    )
