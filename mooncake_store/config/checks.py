"""Checks on single config values: coercion of text and TOML values to a field's type, the range or
format of each field, and the strict type check for dataclasses built in code.

Every problem becomes a :class:`ConfigError` that names the key, the value (a URL with its password
redacted) and the layer it came from.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, urlsplit

import redis
from redis.connection import Connection, parse_url

from mooncake_store.config.fields import _Field, _Source
from mooncake_store.config.values import (
    _FALSE,
    _MAX_SIZE,
    _NAME_RE,
    _TRUE,
    CONFIG_TRANSPORTS,
    _parse_host_port,
    format_size,
    is_ascii_digits,
    is_wildcard_host,
    misplaced_at,
    parse_size,
    redact_url,
    shown,
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
        if value in (".", ".."):
            # Names become path components (an agent's disk directory is disk_path/node_id): "."
            # and ".." would put it in disk_path itself or its parent, whose files it clears.
            return f"{what} cannot be {value!r} (names become directory names)"
        return None

    return check


# Redis numbers its databases with a C int (SELECT, the `databases` setting).
_MAX_REDIS_DB = (1 << 31) - 1


def _resolvable_name(host: str) -> bool:
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


def _netloc(url: str) -> str:
    """The part of ``url`` that urlsplit takes for user, password, host and port: up to the first
    "/", "?" or "#" after the scheme."""
    return re.split(r"[/?#]", url.split("://", 1)[-1], maxsplit=1)[0]


def _unencoded_in_userinfo(url: str, parts: SplitResult | None = None) -> str | None:
    """What is wrong with a URL whose "@" comes after the end of its host part: a "/", "?" or "#"
    in the user name or password, which must be percent-encoded (and redis-py would read it as a
    path, a query or a fragment). ``parts``: the URL as urlsplit read it, where it could."""
    misplaced = misplaced_at(parts) if parts is not None else "@" in url.split("://", 1)[-1]
    if misplaced and "@" not in _netloc(url):
        return (
            "not a valid URL: a '/', '?' or '#' in the user name or password must be percent-encoded "
            "(%2F, %3F, %23), e.g. redis://:p%2Fss@127.0.0.1:6379/0"
        )
    return None


def _check_redis_url(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        parts = urlsplit(value)
        misplaced = _unencoded_in_userinfo(value, parts)
        if misplaced:
            return misplaced  # before any message that would quote the rest of the URL
        scheme = parts.scheme.lower()
        if scheme not in ("redis", "rediss", "unix"):
            return "scheme must be redis://, rediss:// or unix://, e.g. redis://127.0.0.1:6379/0"
        if scheme == "unix":
            if not parts.path:
                return "unix:// needs a socket path, e.g. unix:///run/redis.sock"
        elif not parts.hostname:
            return "needs a host, e.g. redis://127.0.0.1:6379/0"
        # redis-py reads port 0 as "no port" and dials 6379: another server than the one named.
        elif parts.port == 0:
            return "port must be 1..65535, e.g. redis://127.0.0.1:6379/0"
        elif not _resolvable_name(parts.hostname):
            # The socket layer refuses it (an empty or over-long label: "a..b") at connect, which
            # read as a server out of reach (exit 4) rather than a mistake in the URL.
            return f"host {parts.hostname!r} is not a valid host name (empty or over-long label)"
    except ValueError as exc:  # urlsplit's port: out of range or not a number; or a lone bracket
        hostport = _netloc(value).rpartition("@")[2]
        port = hostport.rsplit(":", 1)
        if ("[" in hostport) == ("]" in hostport) and len(port) == 2 and is_ascii_digits(port[1]):
            return f"port must be 1..65535, got {port[1]}, e.g. redis://127.0.0.1:6379/0"
        # The error's text may quote part of a password (urlsplit read it as the port).
        return _unencoded_in_userinfo(value) or f"not a valid URL ({exc})"
    if scheme != "unix":
        db = parts.path.lstrip("/")
        # ASCII only: redis-py silently drops a database it cannot parse ("²") and uses db 0.
        if db and not is_ascii_digits(db):
            return f"database {db!r} must be a number, e.g. redis://127.0.0.1:6379/0"
    return _redis_py_problem(value)


def _redis_py_problem(value: str) -> str | None:
    """What redis-py itself would refuse, found now rather than at the first connect: its URL parser,
    then the connection object built from the URL's options (no I/O: it connects lazily), which
    refuses options it does not know (``?foo=1``) and values it cannot use (``?protocol=9``)."""
    try:
        options = parse_url(value)
        db = options.get("db", 0)
        if not 0 <= db <= _MAX_REDIS_DB:
            return f"database {db} must be in 0..{_MAX_REDIS_DB}"
        numbers = _url_number_problem(options)
        if numbers:
            return numbers
        connection_class = options.pop("connection_class", Connection)
        connection_class(**options)
    except (ValueError, TypeError, redis.RedisError) as exc:
        return f"redis-py cannot use it ({exc})"
    return None


def _url_number_problem(options: dict[str, Any]) -> str | None:
    """What is wrong with the numbers of a URL's query that redis-py takes unchecked (its Connection
    is built from them without a complaint) and that fail only at the first connect: a timeout of
    inf was an OverflowError from the socket layer (an internal error at the CLI), -1 or nan a
    "bad Redis URL" of exit 4, and 0 (a socket that never waits) or a read size of 0 "cannot reach
    Redis", with a server up and answering."""
    for name in ("socket_timeout", "socket_connect_timeout"):
        seconds = options.get(name)
        if seconds is not None and not (math.isfinite(seconds) and 0 < seconds <= _DAY_S):
            return f"{name}={seconds:g} must be > 0 s and <= {_DAY_S:g} s, as client.timeout_s"
    read_size = options.get("socket_read_size")
    if read_size is not None and read_size < 1:
        return f"socket_read_size={read_size} must be >= 1 (bytes read at once)"
    interval = options.get("health_check_interval")
    if interval is not None and interval < 0:
        # Negative, redis-py sends a handshake the server refuses ("unknown subcommand").
        return f"health_check_interval={interval} must be >= 0 s (0: no health checks)"
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
    if isinstance(result, str):
        return result
    host = result[0]
    if not host or is_wildcard_host(host) or _inet_aton_form(host):
        return None
    # A host that is no address or name (a stray byte from argv or env, "h o s t") was taken here
    # and failed only at bind, as an internal error with a traceback.
    return _undialable_host(host, "to listen on")


def _check_advertise(value: str) -> str | None:
    if value == "":
        return None  # the bound address of listen
    # Peers dial this address: port 0 ("any port") and a wildcard host can only be bound, not dialled.
    result = _parse_host_port(value, min_port=1)
    if isinstance(result, str):
        return result
    if is_wildcard_host(result[0]):
        return f"{result[0]} is not an address peers can dial; name this host's address or name"
    return _undialable_host(result[0], "peers can dial")


def _inet_aton_form(host: str) -> bool:
    """An IPv4 address in a form bind() takes (``127.1``, ``0x7f.1``), which no host-name rule does."""
    try:
        socket.inet_aton(host)
    except (OSError, UnicodeError):
        return False
    return True


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _undialable_host(host: str, purpose: str) -> str | None:
    """What keeps peers from dialling ``host``: neither an IP address nor a host name (labels of
    letters, digits, '-' and '_', at most 63 each and 253 in all; the last not all digits, which
    would be an IPv4 address out of range). Taken as given, such an address ("h o s t",
    "256.1.1.1", "a..b") was published in the node table, and every peer's dial of it failed."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        ascii_name = host.encode("idna").decode("ascii").rstrip(".")
    except UnicodeError:
        ascii_name = ""
    labels = ascii_name.split(".")
    if (
        not ascii_name
        or len(ascii_name) > 253
        or not all(_HOST_LABEL.fullmatch(label) for label in labels)
        or labels[-1].isdigit()
    ):
        return f"{host!r} is neither an IP address nor a host name {purpose}"
    return None


def _check_path(value: str) -> str | None:
    if "\0" in value:
        return "a path cannot contain a NUL byte"
    if value.startswith("~") and os.path.expanduser(value) == value:
        return "cannot expand ~ here (no such user, or no HOME)"
    return None


_DAY_S = 86400.0
# Agent loops below a millisecond would only spin (Redis TTLs count in ms); a reservation must live
# long enough for a put's bytes to arrive.
MIN_LOOP_S = 0.001
_MIN_RESERVE_S = 0.1
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
    "client.zone": _check_name("zone"),
    "agent.node_id": _check_name("node_id", allow_empty=True),
    # Smaller than a KV chunk, and so small that the 64 B allocation unit shows in every refusal.
    "agent.host_bytes": _size_range(64 << 10),
    "agent.listen": _check_listen,
    "agent.advertise": _check_advertise,
    "agent.zone": _check_name("zone"),
    "agent.heartbeat_interval_s": _number_range(MIN_LOOP_S, 3600, unit=" s"),
    "agent.heartbeat_ttl_s": _number_range(MIN_LOOP_S, _DAY_S, unit=" s"),
    "agent.reserve_timeout_s": _number_range(_MIN_RESERVE_S, _DAY_S, unit=" s"),
    "agent.sync_interval_s": _number_range(MIN_LOOP_S, 3600, unit=" s"),
    "agent.high_watermark": _number_range(0, 1, lo_open=True),
    # 0 would make every pass of the pressure loop empty the tier.
    "agent.low_watermark": _number_range(0, 1, lo_open=True),
    "agent.pressure_interval_s": _number_range(MIN_LOOP_S, 3600, unit=" s"),
    "agent.disk_path": _check_path,
    "agent.disk_bytes": _size_range(0),
    "agent.gpu_bytes": _size_range(0),
    "agent.gpu_id": _number_range(0, 1023),
}


# --- coercion, and the check of one value against its field -----------------------------------------

_INT_RE = re.compile(r"[+-]?[0-9]+")
#: More digits than any field's range needs (sizes go up to 2**64); what is longer is refused unread.
_MAX_INT_DIGITS = 30


def _show(spec: _Field, value: object) -> str:
    if spec.kind == "optstr" and isinstance(value, str):
        return repr(redact_url(value))
    return shown(value, 200)


def _fail(spec: _Field, value: object, source: _Source, problem: str) -> ConfigError:
    return ConfigError(f"{source.label(spec.key)}={_show(spec, value)}: {problem}")


def _coerce(spec: _Field, value: object, source: _Source) -> object:
    """``value`` (a string from env or CLI, or a TOML value) as the field's type."""
    kind = spec.kind
    if kind == "size":
        return parse_size(value, what=source.label(spec.key))  # type: ignore[arg-type]  # it checks the type
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        # ASCII digits only: int() also takes "٣", "１" and "1_000", which nobody means here.
        if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
            text = value.strip()
            digits = text.lstrip("+-").lstrip("0")
            if len(digits) > _MAX_INT_DIGITS:  # int() refuses past 4300 digits with a bare ValueError
                raise _fail(spec, value, source, f"an integer of {len(digits)} digits, far out of range")
            # The digits past the leading zeros: int() counts those too, and thousands of them
            # ("0000...01") were a bare ValueError, an internal error at the CLI.
            number = int(digits or "0", 10)
            return -number if text.startswith("-") else number
        raise _fail(spec, value, source, "not an integer")
    if kind == "float":
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int past float's range (TOML's `timeout_s = 1000...0`)
                raise _fail(spec, value, source, "too large for a number of this kind (past float range)") from None
        elif isinstance(value, str) and value.isascii() and "_" not in value:
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
        if type(value) is int and value in (0, 1):  # as "1"/"0" are taken: the refusal names 1/0
            return bool(value)
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
