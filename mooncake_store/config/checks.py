"""Checks on single config values: coercion of text and TOML values to a field's type, the range or
format of each field, and the strict type check for dataclasses built in code.

Every problem becomes a :class:`ConfigError` that names the key, the value (a URL with its password
redacted) and the layer it came from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from mooncake_store.config.fields import _Field, _Source
from mooncake_store.config.values import (
    _FALSE,
    _MAX_SIZE,
    _NAME_RE,
    _SIZE_EXAMPLES,
    _TRUE,
    CONFIG_TRANSPORTS,
    _parse_host_port,
    format_size,
    parse_size,
    redact_url,
)
from mooncake_store.errors import ConfigError

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


# --- coercion, and the check of one value against its field -----------------------------------------


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


# --- strict types, for dataclasses built in code (no coercion there) ---------------------------------

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
