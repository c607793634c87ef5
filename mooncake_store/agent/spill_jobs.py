"""What a spill handles (agent/spill.py): a victim to move, a batch with its room on the peer, what
a batch's compare-and-swap did, and what a peer's spill did in all; and how victims are cut into
batches."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from mooncake_store.agent.moves import MoveTarget
from mooncake_store.errors import MooncakeError, TransferTimeout
from mooncake_store.index.schema import BATCH_LIMIT
from mooncake_store.tiers.allocator import ALIGNMENT
from mooncake_store.transport import frames
from mooncake_store.transport.tcp import Reservation
from mooncake_store.types import EvictionCandidate, TierKind, TierUsage

log = logging.getLogger("mooncake.agent")

# ---- the batches' sizes and the peer calls' timeouts (spill.py) ----
#: Lifetime of a spill's reservation guards: longer than any copy needs; the peer's sync deletes
#: a guard as soon as its reservation times out.
GUARD_TTL_MS = 300_000
#: Bytes per batch: bounds what a peer holds reserved for a batch not yet swapped, and how long
#: the first object of a pass waits for its swap. A batch's room is reserved while the batch before
#: it is written, and lives reserve_timeout_s there: both batches' bytes must arrive by then.
BATCH_BYTES = 32 << 20
#: The most one WRITE of a host-tier spill carries: larger objects go in pieces, which the streams
#: share out (agent/spill_writes.py).
PIECE_BYTES = 2 << 20
#: WRITE frames in flight per stream before their acks are read.
WRITE_WINDOW = 4
#: Timeout of each call to a peer (and of each recv and send within it): twice the heartbeat TTL,
#: by which a hung peer is past its deadline, within these bounds (30 s alone held repairs long).
TIMEOUT_S, MIN_TIMEOUT_S = 30.0, 10.0


#: Entries per batch: one RESERVE frame's worth, and one move_replicas call's (the batch's guard
#: is shared by its entries, and a call deletes the guards it used).
MAX_ENTRIES = min(frames.MAX_BATCH, BATCH_LIMIT)


@dataclass(frozen=True, slots=True)
class SpillJob:
    victim: EvictionCandidate
    offset: int  # of the victim in its tier's arena here (host or GPU; 0 on disk)
    #: A disk-tier victim: the size of its chunk file, which is what travels and what the peer stores.
    stored_bytes: int | None = None
    #: A disk-tier victim: what its file takes on the filesystem (whole blocks).
    footprint_bytes: int | None = None

    @property
    def wire_bytes(self) -> int:
        return self.victim.size_bytes if self.stored_bytes is None else self.stored_bytes

    @property
    def room_bytes(self) -> int:
        """The room its leaving makes in its tier here, which is what a pass counts toward its need."""
        return self.wire_bytes if self.footprint_bytes is None else self.footprint_bytes

    def room_on(self, usage: TierUsage | None) -> int:
        """What it is planned to take in a peer's tier (``usage``, from the node table). A peer's
        disk inbox counts a chunk file's whole blocks of its own filesystem, all or nothing per
        batch: planned by the file's length, or in this node's smaller blocks, a batch that fitted
        on paper was refused whole. A peer that publishes no block size is taken to have this
        node's."""
        if self.stored_bytes is None or usage is None:
            return self.room_bytes
        return usage.room_for(self.stored_bytes, otherwise=self.room_bytes)


#: Where an object goes when no peer has room in the tier it is in here: a peer's host tier (every
#: agent has one), then its disk tier; never a GPU tier it was not in (that memory is the
#: engines'). Repairs copy there (agent/repairs.py), and a pressure pass spills there before it
#: evicts (agent/placing.py).
FALLBACK_TIERS = (TierKind.HOST, TierKind.DISK)


def as_other_tier(job: SpillJob, tier: TierKind) -> SpillJob:
    """``job`` planned into a peer's ``tier`` from another tier here: at its plain size, and into a
    disk tier as a chunk file of that size (what compression saves is known only once the file is
    made, just before it goes: agent/payloads.py)."""
    size = job.victim.size_bytes
    return SpillJob(job.victim, job.offset, stored_bytes=size if tier == TierKind.DISK else None)


@dataclass(frozen=True, slots=True)
class Reserved:
    """A batch with its room on the peer (and, from the GPU or disk, its bytes read)."""

    batch: list[SpillJob]
    reservations: list[Reservation]
    #: The end of the batch that the peer had no room for (it took the rest up to its mark): placed
    #: again by the caller, with the batches after it.
    left: list[SpillJob] = field(default_factory=list)
    #: ``left`` was refused for want of a block, not of bytes: the peer's free room is in pieces
    #: too small for them, and the refusal asked it to compact (agent/compaction.py).
    in_pieces: bool = False


@dataclass(slots=True)
class Swapped:
    """What one batch's compare-and-swap did."""

    moved: list[SpillJob] = field(default_factory=list)
    #: Jobs whose swap call failed (its retry too): whether each landed is for the index to say.
    unknown: list[tuple[SpillJob, MoveTarget]] = field(default_factory=list)
    error: MooncakeError | None = None


@dataclass(slots=True)
class SpillResult:
    moved: list[SpillJob] = field(default_factory=list)
    #: Not moved: the peer refused, or broke before their batch was swapped. These may go elsewhere.
    unsent: list[SpillJob] = field(default_factory=list)
    #: The peer refused a reservation or its connection broke: skip it for the rest of the pass.
    refused: bool = False
    #: Alloc ids of those of ``unsent`` whose WRITE the peer refused after reserving room (a moment's
    #: refusal, a reservation that timed out under load, a failing disk): placed again where there is
    #: room, else left where they are for the next pass, not evicted for a refusal that may pass.
    write_refused: set[int] = field(default_factory=set)
    #: Alloc ids of those of ``unsent`` the peer had the bytes for but no block (Reserved.in_pieces):
    #: it is compacting its arena for them, and they may wait for it (pressure.py) before they are
    #: evicted.
    in_pieces: set[int] = field(default_factory=set)
    #: Written jobs of batches whose swap failed in the index, with the peer's copy: whether each
    #: swap landed is unknown (their reservations were expired: the peer keeps those it was told
    #: of, and frees the rest). The caller asks the index (LocalMoves.resolve).
    unknown: list[tuple[SpillJob, MoveTarget]] = field(default_factory=list)
    #: Why those swaps failed.
    error: MooncakeError | None = None


def fitting(jobs: list[SpillJob], room_bytes: int, usage: TierUsage | None) -> int:
    """How many of ``jobs``, from the first, fit in ``room_bytes`` of a peer's tier (``usage``,
    from the node table), each in whole allocation units (ALIGNMENT) or the tier's blocks."""
    taken = 0
    for count, job in enumerate(jobs):
        taken += -(-job.room_on(usage) // ALIGNMENT) * ALIGNMENT
        if taken > room_bytes:
            return count
    return len(jobs)


def batches_of(jobs: list[SpillJob], max_bytes: int) -> list[list[SpillJob]]:
    """Consecutive runs of ``jobs`` of at most ``max_bytes`` (one object at least) and at most
    MAX_ENTRIES entries."""
    out: list[list[SpillJob]] = []
    cur: list[SpillJob] = []
    size = 0
    for job in jobs:
        if cur and (size + job.wire_bytes > max_bytes or len(cur) >= MAX_ENTRIES):
            out.append(cur)
            cur, size = [], 0
        cur.append(job)
        size += job.wire_bytes
    if cur:
        out.append(cur)
    return out


class SilentPeers:
    """Peers that failed on the connection (no answer, a reset, a timeout), left out of every pass
    for a heartbeat TTL: one that heartbeats but does not answer looks the emptiest, and each pass
    would choose it first and wait out its timeout again. By then a hung one is past its deadline
    (and left out by the node table), and one cut off for a moment is asked again. Used by the
    pressure thread only."""

    def __init__(self, leave_out_s: float) -> None:
        self._leave_out_s = leave_out_s
        self._until: dict[str, float] = {}  # node id -> monotonic s

    def now(self) -> set[str]:
        """The node ids left out now."""
        now = time.monotonic()
        for node_id in [n for n, until in self._until.items() if until <= now]:
            del self._until[node_id]
        return set(self._until)

    def note(self, node_ids: set[str]) -> None:
        for node_id in node_ids:
            if node_id not in self._until:
                log.warning("peer %s did not answer a spill; leaving it out for %.0f s", node_id, self._leave_out_s)
            self._until[node_id] = time.monotonic() + self._leave_out_s


class PeerTrouble:
    """Peers a spill could not reach, for the pressure loop to leave out (``take``), and the
    endpoints of those that timed out (hung, not reset), which are sent no FREE until then: they
    would answer it after another timeout, the pressure loop waiting, and reclaim the room at
    their own reservation timeout anyway."""

    def __init__(self) -> None:
        self._unreachable: set[str] = set()  # node ids: RESERVE or WRITEs failed on the connection
        self._hung: set[str] = set()  # endpoints a transfer to timed out
        self._lock = threading.Lock()

    def take(self) -> set[str]:
        with self._lock:
            out, self._unreachable, self._hung = self._unreachable, set(), set()
        return out

    def unreachable(self, node_id: str) -> None:
        with self._lock:
            self._unreachable.add(node_id)

    def note(self, endpoint: str, exc: MooncakeError) -> None:
        if isinstance(exc, TransferTimeout):
            with self._lock:
                self._hung.add(endpoint)

    def hung(self, endpoint: str) -> bool:
        with self._lock:
            return endpoint in self._hung
