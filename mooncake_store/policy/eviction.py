"""What an agent under memory pressure moves, and where (issue: tiers and memory pressure).

Victims: objects with no live pin and no live read lease (a lease means someone read it within the
last lease period: hot), coldest first; among equally cold objects the later chunk of a prefix
chain goes first, so that chains stay prefix-closed (a chain that lost its tail still matches its
head; one that lost its head matches nothing). A batch lookup stamps all chunks of a chain with the
same access time, so the chain position decides within a chain.

Destinations, in order: the node's own next tier if it has room (demote), else the peer with the
most room in the same tier, same zone first (spill), else nothing (evict: this is a cache).

Of the victims with nowhere to go, the last live copies of objects a node's death left short of
their replicas (EvictionCandidate.survivor) are evicted after every other one: with replicas=2 a
node's loss must lose nothing, and a survivor under pressure evicted them coldest first, before
its warmer single copies, in the seconds before the repair copied them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from mooncake_store.types import EvictionCandidate, NodeInfo, TierKind, footprint_bytes

_Job = TypeVar("_Job")

#: Tier order, fastest first; an object demotes to the next one the node has.
TIER_ORDER: tuple[TierKind, ...] = (TierKind.GPU, TierKind.HOST, TierKind.DISK)


class MoveKind(StrEnum):
    DEMOTE = "demote"
    SPILL = "spill"
    EVICT = "evict"


@dataclass(frozen=True, slots=True, kw_only=True)
class Move:
    kind: MoveKind
    tier: TierKind | None = None  # destination tier (demote, spill)
    node_id: str | None = None  # destination node (spill)


def bytes_to_free(
    used_bytes: int,
    capacity_bytes: int,
    *,
    high: float,
    low: float,
    wanted_bytes: int = 0,
    draining: bool = False,
) -> int:
    """How much to move now: nothing below the high watermark unless a reservation is waiting for
    ``wanted_bytes`` or a drain is under way; otherwise enough to get down to the low watermark
    (and to fit the wait). ``draining``: the tier passed its high watermark and has not yet been
    brought under its low one (one pass samples a bounded number of objects, so getting there may
    take several passes, most of them below the high watermark)."""
    over_high = used_bytes > high * capacity_bytes or (draining and used_bytes > low * capacity_bytes)
    if not over_high and wanted_bytes <= 0:
        return 0
    target = used_bytes - int(low * capacity_bytes) if over_high else 0
    room_needed = wanted_bytes - (capacity_bytes - used_bytes)
    return max(0, target, room_needed)


def choose_victims(candidates: Iterable[EvictionCandidate], *, need_bytes: int, now_ms: int) -> list[EvictionCandidate]:
    """The coldest movable candidates whose sizes add up to ``need_bytes`` (or all of them)."""
    if need_bytes <= 0:
        return []
    movable = [c for c in candidates if c.pins == 0 and c.lease_until_ms <= now_ms]
    movable.sort(key=lambda c: (c.last_access_ms, -c.chain_pos, c.key))
    chosen: list[EvictionCandidate] = []
    total = 0
    for cand in movable:
        if total >= need_bytes:
            break
        chosen.append(cand)
        total += cand.size_bytes
    return chosen


def eviction_order(homeless: Iterable[_Job], victim_of: Callable[[_Job], EvictionCandidate]) -> list[_Job]:
    """``homeless`` (victims with nowhere to go, cold-first) in the order they are to be evicted:
    the last live copies of objects short of their replicas after every other one, each group in
    the order given. Not by coldness alone: such an object is as safe as any other only once its
    repair has copied it, and a colder one stored with replicas=1 was promised nothing."""
    jobs = list(homeless)
    return [j for j in jobs if not victim_of(j).survivor] + [j for j in jobs if victim_of(j).survivor]


def next_tier(tier: TierKind, available: Sequence[TierKind]) -> TierKind | None:
    index = TIER_ORDER.index(tier)
    for lower in TIER_ORDER[index + 1 :]:
        if lower in available:
            return lower
    return None


def choose_move(
    size_bytes: int,
    *,
    tier: TierKind,
    node_id: str,
    zone: str,
    lower_tier: TierKind | None,
    lower_free_bytes: int,
    peers: Iterable[NodeInfo],
    now_ms: int,
    high_watermark: float,
    spill: bool = True,
    planned_bytes: Mapping[str, int] | None = None,
    refused: Collection[str] = (),
    stored_bytes: int | None = None,
    holders: Collection[NodeInfo] = (),
    plain_bytes: int | None = None,
    lower_bytes: int | None = None,
    fill_mark: Callable[[NodeInfo], float] | None = None,
    in_pieces_last: bool = False,
) -> Move:
    """Where one victim of ``size_bytes`` goes. A peer qualifies only if taking the object keeps it
    under the high watermark, so that spilling never pushes a peer into pressure of its own.
    ``planned_bytes`` is what this pass already sent each peer (the table's use is a heartbeat
    old); peers in ``refused`` turned a reservation down in this pass. A chunk file of
    ``stored_bytes`` (a disk victim; ``size_bytes`` is what it takes here) takes whole blocks of
    each peer's own filesystem there (TierUsage.room_for). ``holders``: the nodes that hold the
    object's other copies (for a repair, those planned too): a peer on a host none of them is on
    goes first, then one in a zone none of them is in, as placement spreads a put's replicas (two
    copies on one host, or in one zone, are lost together); then the same zone as this node.
    ``plain_bytes``: the object's own size, for a chunk file that goes to a peer's disk tier, which
    takes none larger than its largest memory tier (NodeInfo.largest_chunk_bytes): that peer
    would refuse the WRITE, and be chosen again at every pass. ``lower_bytes``: what it would take
    in ``lower_tier`` when that is not ``size_bytes`` (a host object's chunk file on disk, at most).
    ``fill_mark``: the share of a peer's tier a move may fill it to, where not its high watermark
    (a repair of a copy a full node dropped fills peers only to their low watermark).
    ``in_pieces_last``: a peer whose free room is in pieces none of which holds the object is
    still chosen, after every peer with a block for it (a repair: refused, that peer compacts its
    arena, agent/compaction.py, and takes the copy at a later call); else it is passed over."""
    if lower_tier is not None and lower_free_bytes >= (size_bytes if lower_bytes is None else lower_bytes):
        return Move(kind=MoveKind.DEMOTE, tier=lower_tier)
    if spill:
        hosts = {h.host_id for h in holders}
        zones = {h.zone for h in holders}
        best: tuple[bool, bool, bool, int, int, str] | None = None
        for peer in peers:
            if peer.node_id == node_id or peer.heartbeat_deadline_ms < now_ms or peer.node_id in refused:
                continue
            usage = peer.tier(tier)
            if usage is None:
                continue
            if tier == TierKind.DISK and plain_bytes is not None and plain_bytes > peer.largest_chunk_bytes:
                continue
            used = usage.used_bytes + (planned_bytes or {}).get(peer.node_id, 0)
            takes = size_bytes if stored_bytes is None else usage.room_for(stored_bytes, otherwise=size_bytes)
            in_pieces = 0 < usage.largest_free_bytes < footprint_bytes(takes)
            if in_pieces and not in_pieces_last:
                # Its free room is in pieces, none of which holds this object: the peer would
                # refuse it, and with it the rest of the pass's batch to that peer.
                continue
            # The peer's own watermark when it publishes one, else the caller's.
            peer_high = peer.high_watermark(high_watermark) if fill_mark is None else fill_mark(peer)
            if used + takes > peer_high * usage.capacity_bytes:
                continue
            key = (
                in_pieces,
                peer.host_id in hosts,
                peer.zone in zones,
                0 if peer.zone == zone else 1,
                used - usage.capacity_bytes,
                peer.node_id,
            )
            if best is None or key < best:
                best = key
        if best is not None:
            return Move(kind=MoveKind.SPILL, tier=tier, node_id=best[-1])
    return Move(kind=MoveKind.EVICT)
