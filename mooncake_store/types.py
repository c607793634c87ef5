"""Values shared by every layer: replica locations, object records, node records, enums.

Everything here is plain data (frozen dataclasses, StrEnums) plus the checks on the values that come
from users (keys), so that ``index/``, ``tiers/``, ``transport/`` and ``policy/`` can share them
without importing each other.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from enum import StrEnum

from mooncake_store.errors import InvalidKey, InvalidValue, ProtocolError

#: Longest key accepted, in UTF-8 bytes. Redis keys may be far longer, but a key is also part of
#: every index record and of log lines; vLLM/LMCache block hashes are well under 200 bytes.
MAX_KEY_BYTES = 1024

#: Most dimensions a stored array or tensor may have (host and device alike): a shape is part of
#: every index record, and numpy itself stops at 64.
MAX_DIMS = 32

#: The arenas' allocation unit: every host and GPU allocation is a whole number of these. It lives
#: here rather than in tiers so placement (which may not import tiers) rounds capacities the same way.
ALIGNMENT = 64


def footprint_bytes(size_bytes: int, alignment: int = ALIGNMENT) -> int:
    """What an object of ``size_bytes`` takes in an arena: whole alignment units, one at least (the
    allocator's rule, tiers/allocator.py, which placement and refusals count by too)."""
    return max(alignment, -(-size_bytes // alignment) * alignment)


class ReplicaState(StrEnum):
    PENDING = "PENDING"
    COMPLETE = "COMPLETE"


class TierKind(StrEnum):
    GPU = "gpu"
    HOST = "host"
    DISK = "disk"


class TransportKind(StrEnum):
    """Byte paths, cheapest first (DESIGN.md §4)."""

    INPROC = "inproc"
    SHM = "shm"
    RDMA = "rdma"
    TCP = "tcp"


TRANSPORT_ORDER: tuple[TransportKind, ...] = (
    TransportKind.INPROC,
    TransportKind.SHM,
    TransportKind.RDMA,
    TransportKind.TCP,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Replica:
    """Where one copy of an object lives. ``alloc_id`` is the location's generation: the agent
    issues a fresh one for every allocation, so a location that was freed and reused never
    matches an old lookup."""

    node_id: str
    tier: TierKind
    offset: int
    size_bytes: int
    alloc_id: int
    state: ReplicaState = ReplicaState.COMPLETE


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectMeta:
    key: str
    size_bytes: int
    dtype: str
    shape: tuple[int, ...]
    checksum: int
    replicas: tuple[Replica, ...]
    version: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class TierUsage:
    tier: TierKind
    capacity_bytes: int
    used_bytes: int
    objects: int = 0
    #: hits, misses, demotions, promotions, spills_out, spills_in, evictions; raw_bytes and
    #: stored_bytes for the disk tier (its used_bytes are the whole blocks its files take)
    counters: dict[str, int] = field(default_factory=dict)
    #: The unit a file takes whole units of (the disk tier: its filesystem's block size); 0 where
    #: the tier does not say (an arena tier, or an agent older than this field).
    block_bytes: int = 0
    #: An arena tier's largest free block: its free room may be in pieces, and no object larger
    #: than this fits there now. 0 where the tier does not say (a disk tier, an older agent).
    largest_free_bytes: int = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def room_for(self, stored_bytes: int, *, otherwise: int) -> int:
        """What a chunk file of ``stored_bytes`` takes in this tier: whole blocks, one at least;
        ``otherwise`` where the tier publishes no block size."""
        if self.block_bytes <= 0:
            return otherwise
        return max(1, -(-stored_bytes // self.block_bytes)) * self.block_bytes


#: Alloc ids carry, in bits 47..62, a tag of the agent incarnation that handed them out, which the
#: agent also publishes in the node table: a client whose copy of the table predates a restart of
#: the node (same node id, new arena) sees the replica's tag differ and re-reads the table instead
#: of copying through the old arena's mapping. 47 bits leave 1.4e14 ids per incarnation.
ALLOC_TAG_SHIFT = 47
ALLOC_TAG_BITS = 16


def alloc_tag_of(alloc_id: int) -> int:
    return (alloc_id >> ALLOC_TAG_SHIFT) & ((1 << ALLOC_TAG_BITS) - 1)


def stale_for(replica: Replica, node: NodeInfo | None) -> bool:
    """Whether ``node`` (a client's copy of the node's row) predates the incarnation that holds
    ``replica``: the table must be read again before the replica is reached."""
    return node is not None and node.alloc_tag != 0 and alloc_tag_of(replica.alloc_id) != node.alloc_tag


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo:
    """One row of the node table, as the agent publishes it."""

    node_id: str
    host: str
    host_id: str
    zone: str
    pid: int
    tcp_endpoint: str
    shm_name: str
    transports: tuple[TransportKind, ...]
    tiers: tuple[TierUsage, ...]
    heartbeat_deadline_ms: int = 0
    started_ms: int = 0
    last_heartbeat_ms: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    #: The tag this incarnation of the agent puts in every alloc id it hands out (see
    #: alloc_tag_of); 0 when unknown.
    alloc_tag: int = 0

    def tier(self, kind: TierKind) -> TierUsage | None:
        for usage in self.tiers:
            if usage.tier == kind:
                return usage
        return None

    def high_watermark(self, default: float) -> float:
        """The high watermark the agent publishes (its ``high_watermark`` label), else ``default``.
        A label that is no number (a hand edit, a foreign writer) counts as absent: read raw, it
        failed every pressure pass of every node that planned by it."""
        return self._watermark("high_watermark", default)

    def low_watermark(self, default: float) -> float:
        """The low watermark the agent publishes (``low_watermark``), else ``default``: the use a
        drain takes its tiers down to, under which no pressure pass takes room back."""
        return self._watermark("low_watermark", default)

    def _watermark(self, label: str, default: float) -> float:
        try:
            mark = float(self.labels.get(label, default))
        except ValueError:
            return default
        return mark if 0.0 < mark <= 1.0 else default

    @property
    def largest_chunk_bytes(self) -> int:
        """The most plain bytes a chunk file from a peer may hold in its disk tier: its largest
        memory tier's capacity (Agent._disk_tier: a larger one could never be read back into
        memory there, and checking it would take that much memory)."""
        return max((t.capacity_bytes for t in self.tiers if t.tier != TierKind.DISK), default=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictionCandidate:
    """An object with a replica on a node's tier, with what the eviction policy weighs."""

    key: str
    size_bytes: int
    last_access_ms: int
    lease_until_ms: int
    pins: int
    alloc_id: int
    chain_pos: int  # -1 when the object is not part of a prefix chain
    dtype: str
    children: int = 0  # stored chunks whose chain parent this object is: evicting it would cut them off
    other_nodes: tuple[str, ...] = ()  # nodes holding its other replicas: never a spill target
    chain_parent: str = ""  # key of the chunk before it in its prefix chain ("" for none)
    #: The last live copy of an object that a node's death (or a damaged copy) left short of the
    #: replicas it was stored with, not yet repaired: evicting it loses what replicas=N promised.
    survivor: bool = False


def is_collection_not_text(value: object) -> bool:
    """Whether ``value`` is a collection of items (a list, a tuple, an array's rows), not text or
    bytes, which iterate as characters: one key or one digest passed where several belong."""
    return not isinstance(value, str | bytes | bytearray | memoryview) and hasattr(value, "__iter__")


def check_keys(keys: object) -> list[str]:
    """Every key of a sequence of keys checked; a str or bytes is refused, not split into characters."""
    if not is_collection_not_text(keys):
        raise InvalidValue(f"pass a list of keys, got {type(keys).__name__}: {keys!r:.80}")
    if isinstance(keys, set | frozenset):
        # Results come back one per key in the keys' order; a set's order is its hashing's, so
        # the caller could not tell which result is whose.
        raise InvalidValue(
            f"pass the keys as a list or tuple, not a {type(keys).__name__}: results come back in "
            f"the keys' order, which a {type(keys).__name__} does not keep ({keys!r:.80})"
        )
    return [check_key(k) for k in keys]  # type: ignore[attr-defined]


#: Where the bytes of the command line (or of a file name) that are not UTF-8 land: Python decodes
#: each to a lone surrogate, U+DC80..U+DCFF (surrogateescape: b"\xff" is "\udcff").
_ESCAPED_BYTES = range(0xDC80, 0xDD00)


def shown_text(text: str) -> str:
    """``text`` quoted as repr() quotes it, except that a byte that was not UTF-8 shows as that
    byte, ``\\xff``, rather than as the lone surrogate Python decoded it to (``\\udcff`` named no
    byte the user had typed). So that nothing else looks alike, a character that repr() shows as
    ``\\xNN`` past ASCII (U+0080..U+00FF that do not print: U+0085, U+00A0) shows as ``\\u00NN``."""
    if text.isascii():
        return repr(text)
    quote = '"' if "'" in text and '"' not in text else "'"  # as repr() picks it
    parts: list[str] = []
    for ch in text:
        code = ord(ch)
        if code in _ESCAPED_BYTES:
            parts.append(f"\\x{code - 0xDC00:02x}")
        elif ch in (quote, "\\"):
            parts.append("\\" + ch)
        else:
            shown = repr(ch)[1:-1]
            parts.append(f"\\u{code:04x}" if code <= 0xFF and shown.startswith("\\x") else shown)
    return quote + "".join(parts) + quote


def shown_key(key: str, width: int = 60) -> str:
    """``key`` as a message quotes it (errors, the CLI's lines): whole, or its start and its length,
    quotes closed; bytes that were not UTF-8 as ``\\xff`` (shown_text)."""
    if len(key) <= width:
        return shown_text(key)
    return f"{shown_text(key[:width])}… ({len(key)} characters)"


def _not_utf8(text: str, exc: UnicodeEncodeError) -> str:
    """Why ``text`` cannot be UTF-8, naming the first character at fault and where it is."""
    ch = text[exc.start]
    if ord(ch) in _ESCAPED_BYTES:
        return f"{shown_text(ch)[1:-1]} (character {exc.start + 1}) is a byte that does not decode as UTF-8"
    return f"U+{ord(ch):04X} (character {exc.start + 1}) is a lone surrogate, which UTF-8 cannot encode"


def check_pattern(pattern: object) -> str:
    """A key pattern (glob) for listing: text the index can hold, as a key is (a non-UTF-8 byte
    from the command line arrives as a lone surrogate, which no key can match)."""
    if not isinstance(pattern, str):
        raise InvalidKey(f"key pattern must be str, got {type(pattern).__name__}: {pattern!r:.80}")
    try:
        pattern.encode("utf-8")
    except UnicodeEncodeError as exc:
        why = _not_utf8(pattern, exc)
        raise InvalidKey(f"key pattern {shown_key(pattern)} is not valid UTF-8 text: {why}") from None
    return pattern


def check_key(key: object) -> str:
    """Return ``key`` if it is acceptable, else raise :class:`InvalidKey` saying why."""
    if not isinstance(key, str):
        raise InvalidKey(f"key must be str, got {type(key).__name__}: {key!r:.80}")
    if not key:
        raise InvalidKey("key must not be empty")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKey(f"key {shown_key(key)} is not valid UTF-8 text: {_not_utf8(key, exc)}") from None
    if len(encoded) > MAX_KEY_BYTES:
        raise InvalidKey(f"key {shown_key(key)} is {len(encoded)} B of UTF-8; the limit is {MAX_KEY_BYTES} B")
    for ch in key:
        # C0, DEL and C1 (U+0080..U+009F: NEL breaks lines, CSI starts terminal escapes in `ls`).
        if ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F:
            raise InvalidKey(f"key {shown_key(key)} contains control character {shown_text(ch)}")
    return key


def is_bool(value: object) -> bool:
    """Whether ``value`` is a Python or a numpy bool (``numpy.bool_``, named ``numpy.bool`` since
    numpy 2: a test of the name "bool_" alone missed it there), without importing numpy."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def as_count(value: object) -> int | None:
    """``value`` as an int when it is a whole number of the kinds a caller passes for a count: a
    Python int or a numpy integer (what numpy arithmetic gives: refusing ``np.int64(2)`` where 2 is
    taken is no help), never a bool; None for anything else."""
    if is_bool(value):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """An agent's ``HOST:PORT`` as a node record or a config names it (IPv6 hosts in brackets)."""
    host, _, port = endpoint.rpartition(":")
    # ASCII digits only: "²" passes str.isdigit() and then breaks int() with a bare ValueError.
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ProtocolError(f"bad agent endpoint {endpoint!r}; expected HOST:PORT")
    return host.strip("[]"), int(port)
