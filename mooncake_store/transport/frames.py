"""The agent's binary wire protocol: fixed 32-byte little-endian headers, raw payloads, no pickle.

Request and reply share one header layout::

    magic "MC" | version u8 | op u8 | arg u32 | a u64 | b u64 | c u64

A reply carries ``op | REPLY_BIT`` and a :class:`Status` in ``arg``. Payload lengths are implied by
the op and the header fields, never free-form, and every length is checked against a limit before
anything is received.

========  ===================================  ========================================================
op        request                              reply
========  ===================================  ========================================================
PING      -                                    OK, a = protocol version, b = digest of the agent's
                                               arena name (tiers.host.segment_digest)
RESERVE   arg = count, a = tier (0 host,       OK, payload of count x (offset u64, alloc_id u64);
          1 gpu, 2 disk: spills only, size =
          a whole chunk file), b = flags
          (1: a spill from a peer; 2: a probe,
          refused without making room; 4: the
          put keeps replicas on several nodes),
          payload                              NO_CAPACITY, a = free, b = largest free, c = capacity
          of count x (size u64, put_id 16 B)   (host tier; other tiers leave a, b, c zero)
FREE      arg = count, payload count x u64     OK, a = reservations expired now (freed by the next
          (writer abandons its reservations)   sync unless their commit reached the index)
WRITE     a = alloc_id, b = offset, c = len,   OK; STALE when the allocation is not a live reservation
          payload of len bytes (a disk         covering the range (payload is drained, then dropped),
          reservation takes its whole chunk    or a chunk file fails its checksum.
          file in one WRITE)
                                               Until the agent's next sync learns of a commit, the
                                               writer could still write: clients are trusted.
READ      a = alloc_id, b = offset, c = len    OK then len bytes; STALE when the allocation is gone.
                                               A disk-tier alloc id is read (and checked) from its
                                               file; offset is then relative to the object
FENCE     arg = count, payload count x u64     OK, a = digest of the host arena's segment name,
          (host-tier reservations a same-host  b = count, payload count x u8 (1: fenced, a live
          writer copies into itself)           reservation; a free only dooms it until UNFENCE on
                                               this connection, or its close: never on a timer)
UNFENCE   arg = count, payload count x u64     OK, b = count, payload count x u8 (1: still live, the
                                               copy counts; 0: freed meanwhile, the copy is void)
DIGEST    a = alloc_id, b = offset, c = len    OK, a = xxh3-64 of the len bytes at offset as they are
          (a TCP writer's checksum of what     in the arena; STALE when the allocation is not a live
          landed, sent behind its WRITE)       host-tier reservation covering the range
any       the first request on a connection    BUSY, a = the agent's connection limit, then the close:
          past the agent's connection limit    the agent serves that many connections at once
========  ===================================  ========================================================

An agent bounds each request as a whole, not only each recv and send: its bytes must arrive (and a
READ's reply leave) within the agent's timeout plus their length at a minimum rate
(MIN_RATE_BPS), or the connection is closed as if the peer had died. A client bounds each reply
it reads the same way.
"""

from __future__ import annotations

import contextlib
import math
import operator
import socket
import struct
import time
import zlib
from collections.abc import Iterable, Sequence
from enum import IntEnum

from mooncake_store.errors import InvalidValue, ProtocolError, TransferError, TransferTimeout

MAGIC = b"MC"
VERSION = 1
REPLY_BIT = 0x80
HEADER = struct.Struct("<2sBBIQQQ")
HEADER_BYTES = HEADER.size
RESERVE_ENTRY = struct.Struct("<Q16s")
RESERVE_REPLY = struct.Struct("<QQ")
U64 = struct.Struct("<Q")
U64_MAX = (1 << 64) - 1
#: Entries in one RESERVE or FREE frame; a larger batch is split by the client.
MAX_BATCH = 8192
#: RESERVE's tier (header field a).
TIER_HOST = 0
TIER_GPU = 1
#: Spills from a peer's disk tier only: each reservation receives one whole chunk file.
TIER_DISK = 2
TIER_NAMES = {TIER_HOST: "host", TIER_GPU: "gpu", TIER_DISK: "disk"}
#: RESERVE flag (header field b): the reservation is a spill from a peer agent.
SPILL_FLAG = 1
#: RESERVE flag: a writer that has other nodes to try asks; a refusal makes no room here (it is
#: asked again without the flag once no node takes the object). A node refused first, and full of
#: objects, evicted for a writer who went to another node with room. Agents of earlier builds
#: ignore it and make room, as they did.
PROBE_FLAG = 2
#: RESERVE flag: the writer's put keeps replicas on several nodes. Room made for it here is made
#: by demotion or eviction, not by spills to peers: those peers are where the put's other replicas
#: need room, and agents asked in turn spilled the same objects to and fro until the put timed out
#: (a replicas=3 put on three nodes whose free room was in pieces). Agents of earlier builds ignore
#: it.
REPLICATED_FLAG = 4
#: RESERVE flag, beside REPLICATED_FLAG: bits REPLICA_PEER_SHIFT.. of the flags mark the nodes that
#: hold, or are to hold, the put's other replicas (replica_peer_bit: a bit per node id's hash, so a
#: mark may stand for more than one node). The node asked makes the room by spills to its other
#: peers, and by demotion or eviction only where none is left: without the marks, every peer was
#: spared, and a replicas=2 put asking a full node for room evicted its objects while a third node
#: had room for them all. A writer of an earlier build sends REPLICATED_FLAG alone (every peer
#: spared), and agents of earlier builds ignore this flag and the marks.
REPLICA_PEERS_FLAG = 8
REPLICA_PEER_SHIFT = 16
REPLICA_PEER_BITS = 48
#: The marks of every peer (REPLICATED_FLAG without REPLICA_PEERS_FLAG).
ALL_REPLICA_PEERS = ((1 << REPLICA_PEER_BITS) - 1) << REPLICA_PEER_SHIFT
#: The slowest a request's bytes may arrive (and a READ's reply leave), beyond the first
#: timeout_s: a request must be done by timeout_s + its length / MIN_RATE_BPS from its header's
#: first byte. timeout_s bounds each recv and send only, so a peer sending a byte per timeout
#: would hold a WRITE's reservation (or a READ's allocation) and a thread for ever. 1 MiB/s is
#: about a thousandth of a 10 Gb/s link, far below what even a writer sharing one with dozens of
#: streams gets, and still cuts a trickled 1 GiB WRITE off within 18 minutes. A client waits for
#: an agent's reply by the same rule (ConnectionPool.recv_within).
MIN_RATE_BPS = 1 << 20


class Op(IntEnum):
    PING = 1
    RESERVE = 2
    FREE = 3
    WRITE = 4
    READ = 5
    #: Fence host-tier reservations for a writer that copies into the shared arena itself (a
    #: same-host peer): until UNFENCE on the same connection, or its close, a free only dooms them.
    FENCE = 6
    UNFENCE = 7
    #: The checksum of a reservation's bytes as they landed, taken by the agent: what a TCP writer
    #: commits, so a source changed while it was sent is still stored with its own checksum.
    DIGEST = 8


class Status(IntEnum):
    OK = 0
    NO_CAPACITY = 1
    STALE = 2
    BAD_REQUEST = 3
    INTERNAL = 4
    #: The agent is at its connection limit (a = the limit) and closes this connection. No version
    #: bump: it is sent only where an agent used to close without a word, as the first reply on a
    #: connection, and a bump would make every agent and client of another build refuse each other
    #: outright. A client of an earlier build reads it as an unknown status (or, in PING and FREE,
    #: which ignore the status, the limit as a version or count) where it used to see a reset.
    BUSY = 5


#: A READ's STALE reply with this in ``a``: the agent's budget for decoded and copied-out objects
#: (agent/read_budget.py) stayed full for as long as the READ waits; ``b`` is what it held and ``c``
#: the budget. Any other STALE READ has 0 there (no such allocation now): a reader of an earlier
#: build ignores the fields either way.
STALE_READS_HELD = 1
#: A READ's STALE reply with this in ``a``: the agent holds the allocation (a disk tier's file,
#: kept) but could not read it now, for a reason of its own that its log names (out of memory or
#: descriptors, permissions changed under it). Told as gone, the reader's error hid that.
STALE_UNREADABLE = 2


def replica_peer_bit(node_id: str) -> int:
    """The mark of ``node_id`` among a RESERVE's replica peers (REPLICA_PEERS_FLAG): stable across
    processes and builds (crc32, not Python's salted hash)."""
    return 1 << (REPLICA_PEER_SHIFT + zlib.crc32(node_id.encode()) % REPLICA_PEER_BITS)


def replicated_flags(other_nodes: Iterable[str]) -> int:
    """The RESERVE flags of a writer asking a node for room for a put whose other replicas are on
    (or assigned to) ``other_nodes``."""
    marks = 0
    for node_id in other_nodes:
        marks |= replica_peer_bit(node_id)
    return REPLICATED_FLAG | REPLICA_PEERS_FLAG | marks


def spared_peers(flags: int) -> int:
    """The marks of the peers that room made for a RESERVE with ``flags`` must not be spilled to
    (replica_peer_bit): none for a put with one replica, every one for a replicated put's writer
    of an earlier build, else those its writer named."""
    if not flags & REPLICATED_FLAG:
        return 0
    return flags & ALL_REPLICA_PEERS if flags & REPLICA_PEERS_FLAG else ALL_REPLICA_PEERS


def pack(op: int, arg: int = 0, a: int = 0, b: int = 0, c: int = 0) -> bytes:
    try:
        return HEADER.pack(MAGIC, VERSION, op, arg, a, b, c)
    except struct.error:  # a negative or oversized field: say which and its range, not struct's words
        fields = {"op": (op, 0xFF), "arg": (arg, 0xFFFF_FFFF), "a": (a, U64_MAX), "b": (b, U64_MAX), "c": (c, U64_MAX)}
        bad = [
            f"{name}={value!r} (0..{limit})"
            for name, (value, limit) in fields.items()
            if not isinstance(value, int) or not 0 <= value <= limit
        ]
        raise InvalidValue(f"frame header field(s) out of range: {', '.join(bad)}") from None


def pack_reserve_entry(size: int, put_id: bytes) -> bytes:
    try:
        return RESERVE_ENTRY.pack(size, put_id)
    except struct.error as exc:
        raise InvalidValue(
            f"reservation size {size} (0..2**64-1) or put id {put_id!r:.40} does not fit: {exc}"
        ) from None


def pack_ids(alloc_ids: Sequence[int]) -> bytes:
    """The payload of a FREE, FENCE or UNFENCE frame: one u64 per alloc id."""
    try:
        return struct.pack(f"<{len(alloc_ids)}Q", *alloc_ids)
    except struct.error:
        bad = next(x for x in alloc_ids if not _fits_u64(x))
        raise InvalidValue(f"alloc id {bad!r:.40} is not an int in 0..{U64_MAX}") from None


def _fits_u64(value: object) -> bool:
    """As struct's Q takes it: any integer type (numpy's too) in 0..2**64-1."""
    try:
        return 0 <= operator.index(value) <= U64_MAX  # type: ignore[arg-type]
    except TypeError:
        return False


def unpack_ids(raw: bytes | bytearray | memoryview) -> list[int]:
    """The alloc ids of a FREE, FENCE or UNFENCE payload."""
    return [x for (x,) in U64.iter_unpack(raw)]


def unpack(raw: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int]:
    magic, version, op, arg, a, b, c = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}; expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"frame version {version}; this build speaks {VERSION}")
    return op, arg, a, b, c


def kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` blocking, bounded by the kernel's own send and receive timeouts.

    Python's timeout mode makes a socket non-blocking and poll()s before every recv and send: two
    system calls per chunk of a large transfer, and MSG_WAITALL has no effect. SO_RCVTIMEO and
    SO_SNDTIMEO bound each call just the same; one that runs out raises BlockingIOError (EAGAIN)."""
    sock.settimeout(None)
    timeval = _timeval(timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _timeval(timeout_s: float) -> bytes:
    # Whole microseconds, rounded up: a timeval of zero means "never time out" to the kernel.
    usec = max(1, math.ceil(timeout_s * 1_000_000))
    return struct.pack("ll", usec // 1_000_000, usec % 1_000_000)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket, straight into the caller's memory (no staging copy)."""
    got = 0
    total = len(view)
    # On a blocking socket the kernel fills the whole view in one call; with a Python timeout the
    # flag has no effect (the socket is non-blocking underneath) and the loop does the rest.
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    while got < total:
        n = sock.recv_into(view[got:], total - got, flags)
        if n == 0:
            raise TransferError(f"peer closed the connection after {got} of {total} B")
        got += n


def send_all(sock: socket.socket, header: bytes, payload: memoryview | None = None) -> None:
    """Send a header and a payload with one sendmsg where the kernel takes it all at once."""
    if payload is None or len(payload) == 0:
        sock.sendall(header)
        return
    sent = sock.sendmsg([header, payload])
    if sent < len(header):
        sock.sendall(memoryview(header)[sent:])
        sent = len(header)
    if sent - len(header) < len(payload):
        sock.sendall(payload[sent - len(header) :])


def recv_into_by(sock: socket.socket, view: memoryview, deadline: float, timeout_s: float) -> None:
    """recv_into_exact, bounded as a whole by ``deadline`` (time.monotonic()) on a socket set up by
    kernel_timeouts(sock, timeout_s). SO_RCVTIMEO bounds each recv only: a recv that got a byte
    before its timer ran out returns it, and the next starts a fresh timer, so a peer that sends a
    byte per timeout would keep one request going for ever.

    A blocking recv with MSG_WAITALL comes back short only when its timer ran out (or a signal
    came), so a transfer that keeps up is one call with no check at all: the deadline is looked at
    only after a short one, and once it is nearer than timeout_s the timer is cut to what is left
    (and set back to timeout_s at the end). Raises TransferTimeout past the deadline."""
    total = len(view)
    got = 0
    shortened = False
    try:
        while got < total:
            n = sock.recv_into(view[got:] if got else view, total - got, socket.MSG_WAITALL)
            if n == 0:
                raise TransferError(f"peer closed the connection after {got} of {total} B")
            got += n
            if got < total:
                progress = f"{got} of {total} B arrived"
                shortened = _cut_timer(sock, socket.SO_RCVTIMEO, deadline, timeout_s, progress) or shortened
    finally:
        if shortened:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout_s))


def send_all_by(
    sock: socket.socket, header: bytes, payload: memoryview | None, deadline: float, timeout_s: float
) -> None:
    """send_all, bounded as a whole by ``deadline`` as recv_into_by is: a peer that takes a few
    bytes per timeout would otherwise keep one reply (and what it holds: a READ's allocation, which
    a free then only dooms) going for ever. A blocking send comes back short only when its timer
    ran out, so a reply that goes out at once is one sendmsg with no check."""
    parts = [memoryview(header)] if payload is None or len(payload) == 0 else [memoryview(header), payload]
    total = sum(len(p) for p in parts)
    sent = sock.sendmsg(parts)
    shortened = False
    try:
        while sent < total:
            progress = f"{sent} of {total} B went out"
            shortened = _cut_timer(sock, socket.SO_SNDTIMEO, deadline, timeout_s, progress) or shortened
            head = len(header)
            sent += sock.sendmsg([parts[0][sent:], *parts[1:]] if sent < head else [parts[1][sent - head :]])
    finally:
        if shortened:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))


def _cut_timer(sock: socket.socket, option: int, deadline: float, timeout_s: float, progress: str) -> bool:
    """After a short recv or send: TransferTimeout past the deadline, else whether the kernel timer
    was cut to the time left (it was nearer than timeout_s)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"not done by its deadline: {progress}")
    if left < timeout_s:
        sock.setsockopt(socket.SOL_SOCKET, option, _timeval(left))
        return True
    return False
