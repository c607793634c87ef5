"""Parsing and printing of config values: sizes, HOST:PORT, URLs with their passwords hidden."""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from decimal import Decimal, InvalidOperation
from urllib.parse import SplitResult, urlsplit, urlunsplit

from mooncake_store.errors import ConfigError

ENV_PREFIX = "MOONCAKE_"

#: ``MOONCAKE_*`` variables that are read elsewhere and are not config keys. Any other ``MOONCAKE_*``
#: variable that matches no key is an error, because it is almost always a misspelt key.
NON_CONFIG_ENV_VARS: frozenset[str] = frozenset({"MOONCAKE_CONFIG", "MOONCAKE_REDIS_SERVER", "MOONCAKE_STATE_DIR"})

#: Transports a client may be configured with (``inproc`` is implicit: it is always tried first).
CONFIG_TRANSPORTS: tuple[str, ...] = ("shm", "tcp", "rdma")

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# ASCII only: \d alone would take fullwidth and other Unicode digits, which nobody means in a size.
_SIZE_RE = re.compile(r"(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)", re.IGNORECASE | re.ASCII)
_SIZE_EXAMPLES = "examples: 512MiB, 1GiB, 1073741824"
# "i" means binary, everything else decimal, as in IEC and Kubernetes; so "10MB" is 10**7 bytes.
# A bare "e" is left out: "1e" reads as a number in scientific notation cut short, not as 10**18 B.
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{f"{p}": 1000**e for e, p in enumerate("kmgtp", start=1)},
    **{f"{p}b": 1000**e for e, p in enumerate("kmgtpe", start=1)},
    **{f"{p}i": 1024**e for e, p in enumerate("kmgtpe", start=1)},
    **{f"{p}ib": 1024**e for e, p in enumerate("kmgtpe", start=1)},
}
# Sizes travel as signed 64-bit integers (Redis integers, struct "q" in frames).
_MAX_SIZE = (1 << 63) - 1
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_size(text: str | int | float, *, what: str = "size") -> int:
    """Bytes in ``text``: ``"512MiB"``, ``"1.5GiB"``, ``"10MB"`` (decimal), ``"1073741824"``, an int
    or a whole float (``4e9``).

    Units are case-insensitive; a fractional result with a unit is rounded down to whole bytes, while a
    fractional count of bytes (``"1.5"``) is refused. ``what`` prefixes the error message, so callers
    pass the key and layer the value came from.
    """
    shown_text = shown(text)
    if isinstance(text, bool) or not isinstance(text, int | float | str):
        raise ConfigError(f"{what}={shown_text}: not a size ({_SIZE_EXAMPLES})")
    if isinstance(text, float):
        # Python writes large counts as 4e9 or 2**32 / 2: taken when whole, like "4000000000".
        if not math.isfinite(text):
            raise ConfigError(f"{what}={shown_text}: not a size ({_SIZE_EXAMPLES})")
        if not text.is_integer():
            raise ConfigError(f"{what}={shown_text}: not a whole number of bytes")
        number = Decimal(text)
    elif isinstance(text, int):
        number = Decimal(text)
    else:
        stripped = text.strip()
        if stripped.startswith("-"):
            raise ConfigError(f"{what}={shown_text}: a size cannot be negative")
        match = _SIZE_RE.fullmatch(stripped)
        unit = _SIZE_UNITS.get(match.group("unit").lower()) if match else None
        if match is None or unit is None:
            raise ConfigError(f"{what}={shown_text}: not a size ({_SIZE_EXAMPLES})")
        try:
            number = Decimal(match.group("num")) * unit
        except InvalidOperation:  # pragma: no cover - the regex admits only plain decimals
            raise ConfigError(f"{what}={shown_text}: not a size ({_SIZE_EXAMPLES})") from None
        if unit == 1 and number != number.to_integral_value():
            # Rounding "1.5" down to 1 B would silently give a far smaller size than meant.
            raise ConfigError(f"{what}={shown_text}: not a whole number of bytes (did you mean a unit, e.g. 1.5GiB?)")
    if number < 0:
        raise ConfigError(f"{what}={shown_text}: a size cannot be negative")
    if number > _MAX_SIZE:
        raise ConfigError(f"{what}={shown_text}: larger than the limit of {_MAX_SIZE} B")
    return int(number)


def shown(value: object, width: int = 80) -> str:
    """``repr(value)`` for a message, cut to ``width`` characters. An int of more digits than
    ``repr`` converts (4300) raised ValueError in the very message refusing it: it is told by size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * width:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    return f"{value!r:.{width}}"


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


def split_host_port(text: str, *, what: str = "") -> tuple[str, int]:
    """``"HOST:PORT"`` or ``"[V6]:PORT"`` as ``(host, port)`` (brackets removed); :class:`ConfigError`
    if malformed. ``what`` names the value in the message (``"agent.listen"``)."""
    result = _parse_host_port(text)
    if isinstance(result, str):
        raise ConfigError(f"{what}={text!r}: {result}" if what else f"{text!r}: {result}")
    return result


def is_ascii_digits(text: str) -> bool:
    """Only 0-9: ``str.isdigit()`` is also true for "²" and other digits ``int()`` refuses or misreads."""
    return text.isascii() and text.isdigit()


def is_wildcard_host(host: str) -> bool:
    """``0.0.0.0``, ``::`` and their spellings: an address to bind on, never one to dial. The
    socket layer also reads ``0``, ``0x0`` or ``0.0.0.00`` as 0.0.0.0 (inet_aton's forms), which
    ``ipaddress`` calls no address at all: bound, they listened on every interface unchecked."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        pass
    try:
        return socket.inet_aton(host) == bytes(4)
    except (OSError, UnicodeError):
        return False  # a hostname, or text that is none (undecodable bytes from argv or env)


def _parse_host_port(text: object, *, min_port: int = 0) -> tuple[str, int] | str:
    """``(host, port)``, or the problem with ``text``; ``min_port=1`` for an address that is dialled
    (port 0 can only be bound: "any free port")."""
    if not isinstance(text, str):
        return "expected HOST:PORT text, e.g. 127.0.0.1:0"
    host, sep, port_text = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    # An unbracketed IPv6 address is ambiguous: is the last group the port or part of the address?
    if not sep or not host or (":" in host and not bracketed):
        return "expected HOST:PORT, e.g. 127.0.0.1:0 or [::1]:0"
    if not is_ascii_digits(port_text) or not min_port <= int(port_text) <= 65535:
        return f"port {port_text!r} is not in {min_port}..65535"
    return host, int(port_text)


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, so it can go into messages and logs: the one
    in ``user:password@`` and the one redis-py also takes as ``?password=`` (or ``ssl_password``).
    A URL that does not parse, or parses with no host (a mistyped scheme, a missing slash), has
    everything between its scheme and its last ``@`` hidden: what is there may be a password."""
    hidden = _QUERY_PASSWORD.sub(r"\1\2=***", url)
    try:
        parts = urlsplit(hidden)
    except ValueError:
        return _hidden_before_at(hidden)
    if parts.password is not None:
        netloc = parts.netloc.rpartition("@")
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))
    if "@" not in hidden or (_well_formed(parts) and not misplaced_at(parts)):
        return hidden  # no password (a user name alone is no secret; an "@" in a query value is none)
    return _hidden_before_at(hidden)


def _well_formed(parts: SplitResult) -> bool:
    """A URL with a scheme, a host (or a unix socket's path) and a port that is a number."""
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is no number)
    except ValueError:
        return False
    return bool(parts.scheme) and bool(parts.hostname or (parts.scheme == "unix" and parts.path))


def misplaced_at(parts: SplitResult) -> bool:
    """Whether an "@" that belongs before the host ended up after it: a "/", "?" or "#" in a
    password that is not percent-encoded ends urlsplit's host part early ("admin:2024#pw@db"
    reads as host admin, port 2024), and what comes before that "@" may be a secret. An "@" in
    the path (a Redis database is digits), the fragment, or a query parameter's name is one."""
    if "@" in parts.netloc:
        return False
    names = (part.partition("=")[0] for part in parts.query.split("&"))
    return "@" in parts.path or "@" in parts.fragment or any("@" in name for name in names)


def _hidden_before_at(text: str) -> str:
    """``text`` with all before its last ``@`` hidden, but a scheme it starts with."""
    if "@" not in text:
        return text
    scheme, sep, rest = text.partition("://")
    keep = f"{scheme}{sep}" if sep and _SCHEME.fullmatch(scheme) else ""
    return f"{keep}***@{(rest if keep else text).rpartition('@')[2]}"


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
#: A password in a URL's query (redis-py reads ``password`` and ``ssl_password`` there).
_QUERY_PASSWORD = re.compile(r"(?i)([?&])((?:ssl_)?password)=[^&#]*")


def transport_names(transports: object) -> tuple[str, ...]:
    """The names in ``transports`` (one name, or an iterable of names), checked for type here
    (the config check names unknown ones)."""
    if isinstance(transports, str):
        return (transports,)  # one name is a transport, not a sequence of one-letter ones
    try:
        names = tuple(transports)  # type: ignore[call-overload]
    except TypeError:
        raise ConfigError(
            f"transports must be a name or an iterable of names (shm, tcp, rdma), got "
            f"{type(transports).__name__}: {transports!r:.80}"
        ) from None
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise ConfigError(f"transports must be names (shm, tcp, rdma), got {type(bad[0]).__name__}: {bad[0]!r:.80}")
    return names
