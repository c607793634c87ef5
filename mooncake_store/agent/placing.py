"""Where each victim of a pressure pass goes, as the tiers issue wants it: demoted to this agent's
next tier if there is room, else spilled to the peer with the most room in that tier, else to
another tier of a peer's (FALLBACK_TIERS: nothing is lost while the cluster has room for it), else
evicted; a demotion is carried out as soon as it is chosen. The pass itself (pressure.py) samples the
victims and carries out the spills and evictions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake_store.agent.moves import Demotion, LocalMoves
from mooncake_store.agent.spill import SpillJob
from mooncake_store.agent.spill_jobs import FALLBACK_TIERS, as_other_tier
from mooncake_store.policy.eviction import Move, MoveKind, choose_move, next_tier
from mooncake_store.tiers.chunk_format import file_bytes_at_most
from mooncake_store.types import NodeInfo, TierKind

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent


#: A pass's spills: victims by the peer and the peer's tier they go to.
Spills = dict[tuple[str, TierKind], list[SpillJob]]


@dataclass(slots=True)
class PassState:
    """What one pass of the pressure loop has learnt and planned so far, as it walks its victims."""

    peers: list[NodeInfo]
    #: Per tier of the peers, what this pass sent each peer there (the table's use is a heartbeat old).
    planned: dict[TierKind, dict[str, int]] = field(default_factory=dict)
    #: The room each spilled victim (by alloc id) makes here when it leaves, for those planned into
    #: another tier of a peer's (a host object as a chunk file, a chunk file decoded): the job that
    #: travels then says what it takes there.
    room_here: dict[int, int] = field(default_factory=dict)
    #: Peers left out for the rest of the pass: silent or spared ones, and those that did not answer
    #: one of its spills (a timeout, a reset: asked again, a hung peer cost the pass its timeout
    #: once more).
    refused: set[str] = field(default_factory=set)
    #: Tiers of peers that turned a spill down in this pass (filled since the node table was read,
    #: their writes refused): the peer's other tiers may still take the victims. Left out whole
    #: instead, a peer whose host tier had filled was not offered its nearly empty disk tier, and
    #: the victims were evicted.
    refused_tiers: set[tuple[str, TierKind]] = field(default_factory=set)
    #: Chunks of a chain evicted in this pass, by their parent's key: the sample's children counts
    #: are that much too high, and a parent whose last child went is a leaf now (evict.lua still
    #: checks atomically, so a count too low here cannot cut a chain).
    children_gone: Counter[str] = field(default_factory=Counter)
    #: Victims to evict, in the order the pass chose them, sent in one index round trip once the
    #: pass has chosen enough (evict.lua takes them in order, so a leaf goes before its parent).
    evictions: list[SpillJob] = field(default_factory=list)
    #: A chain chunk that stored chunks hang off is among the evictions queued: they go through
    #: evict_chains.lua (Evictions.evict_queued, agent/evicting.py).
    chains_queued: bool = False
    #: A demotion failed in this pass (the host tier's room below the GPU was in pieces, or the
    #: disk's writes fail): the next tier down counts as full for the rest of it, so victims spill
    #: before they are evicted.
    demote_failed: bool = False
    #: A victim whose chunk file's bound did not fit in the disk's room was demoted on the chance
    #: that its file would (_demote_if_file_fits): once a pass, as it costs a compression.
    tried_tight_disk: bool = False
    #: The index's time as the pass began, before its sample was taken: an object accessed after
    #: it (read, or extended or written by a store) is not evicted by this pass (evict.lua TOUCHED).
    sampled_ms: int | None = None
    #: Victims refused for an access since the pass began, and for that alone: recency is a
    #: preference, and they go too once the rest could not make the room (pressure.py _walk).
    touched: list[SpillJob] = field(default_factory=list)
    by_id: dict[str, NodeInfo] = field(init=False)

    def __post_init__(self) -> None:
        self.by_id = {peer.node_id: peer for peer in self.peers}

    def refused_in(self, tier: TierKind) -> set[str]:
        """The peers that are no destination in ``tier`` for the rest of the pass."""
        return self.refused | {node_id for node_id, refused in self.refused_tiers if refused == tier}

    def turned_down(self, node_id: str, tier: TierKind, *, unreachable: bool) -> None:
        """A peer refused a spill into ``tier``, or did not answer it (``unreachable``: then all of
        it is left out)."""
        if unreachable:
            self.refused.add(node_id)
        else:
            self.refused_tiers.add((node_id, tier))

    def plan(self, node_id: str, jobs: list[SpillJob], tier: TierKind, sign: int = 1) -> None:
        """Count ``jobs`` as sent to a peer (``sign`` -1: taken back), in the room they take there."""
        usage = self.by_id[node_id].tier(tier)
        on_tier = self.planned.setdefault(tier, {})
        on_tier[node_id] = on_tier.get(node_id, 0) + sign * sum(job.room_on(usage) for job in jobs)

    def spill(self, spills: Spills, job: SpillJob, move: Move, tier: TierKind) -> None:
        """Plan ``job`` (of ``tier`` here) to go where ``move`` sends it: into ``spills``, keyed by
        the peer and its tier, in the form that tier keeps."""
        assert move.node_id is not None
        target = tier if move.tier is None else move.tier
        sent = job if target == tier else as_other_tier(job, target)
        if sent is not job:
            self.room_here[job.victim.alloc_id] = job.room_bytes
        spills.setdefault((move.node_id, target), []).append(sent)
        self.plan(move.node_id, [sent], target)


class Placer:
    """Places victims, one at a time, and carries out their demotions (agent/moves.py)."""

    def __init__(self, agent: Agent, moves: LocalMoves) -> None:
        self.agent = agent
        self.moves = moves

    def place(self, job: SpillJob, now_ms: int, state: PassState, tier: TierKind, *, demote: bool = True) -> Move:
        """Where a victim of ``tier`` goes: sized by what it occupies there (a chunk file on disk).
        ``demote`` False: not to the tier below (its demotion was tried and failed)."""
        agent = self.agent
        victim = job.victim
        lower = next_tier(tier, agent.tier_kinds())
        lower_free = 0 if state.demote_failed or not demote else self.room_below(lower)
        lower_takes = job.room_bytes
        if lower == TierKind.DISK and agent.disk is not None:
            # Planned by the longest file it can make (the header, incompressible bytes): at its
            # plain size a file could take more blocks than the room it was planned into.
            lower_takes = agent.disk.footprint(file_bytes_at_most(victim.size_bytes))
        # A node that holds another replica is no destination: two copies on one node are one.
        holding = set(victim.other_nodes)
        holders = [state.by_id[n] for n in victim.other_nodes if n in state.by_id]
        move = choose_move(
            job.room_bytes,
            tier=tier,
            node_id=agent.node_id,
            zone=agent.config.zone,
            lower_tier=lower,
            lower_free_bytes=lower_free,
            lower_bytes=lower_takes,
            peers=state.peers,
            now_ms=now_ms,
            high_watermark=agent.config.high_watermark,
            spill=agent.config.spill_to_peers,
            planned_bytes=state.planned.get(tier, {}),
            refused=state.refused_in(tier) | holding,
            stored_bytes=job.stored_bytes,
            holders=holders,
            plain_bytes=victim.size_bytes,
            # A peer whose room is in pieces too small for the victim is asked last: its refusal
            # makes it compact, and the pass waits for that (pressure.py, PIECES_WAIT_S). Passed
            # over, it was never asked, never compacted, and the victim was evicted.
            in_pieces_last=True,
        )
        if move.kind != MoveKind.EVICT or not agent.config.spill_to_peers:
            return move
        # No peer has room in this tier: another tier of a peer's before the object is lost (a
        # chunk file to a disk-less peer's empty host tier, a host object to a peer's disk), as a
        # repair's copy goes (agent/repairs.py); each tier leaves out the peers that refused it.
        for other in (t for t in FALLBACK_TIERS if t != tier):
            refused = state.refused_in(other) | holding
            found = peer_target(
                agent, job, tier, (other,), state.peers, now_ms, state.planned, refused, holders, in_pieces_last=True
            )
            if found is not None:
                return Move(kind=MoveKind.SPILL, tier=found[1], node_id=found[0])
        return move

    def place_demoting(self, job: SpillJob, now_ms: int, state: PassState, tier: TierKind) -> Move:
        """Place a victim and carry out a demotion at once (the others are queued by the caller). A
        demotion that fails places the victim again without the tier below: on a peer if one has
        room, else it is evicted, as when the tier below had none."""
        move = self.place(job, now_ms, state, tier)
        if move.kind != MoveKind.DEMOTE:
            return self._demote_if_file_fits(job, state, tier, otherwise=move)
        if tier == TierKind.GPU:
            if self.moves.demote_gpu(job.victim, job.offset):
                return move
            state.demote_failed = True  # the host tier's room was in pieces
            return self.place(job, now_ms, state, tier, demote=False)
        done = self.moves.demote_to_disk(job.victim, job.offset)
        if done:
            return move
        # A file that did not fit (a peer's reservation took the room meanwhile: the next victim
        # reads it again) or an object that changed says nothing of the rest of the pass.
        state.demote_failed = state.demote_failed or done is Demotion.FAILED
        return self.place(job, now_ms, state, tier, demote=False)

    def _demote_if_file_fits(self, job: SpillJob, state: PassState, tier: TierKind, *, otherwise: Move) -> Move:
        """A host victim whose file's bound did not fit in the disk's room may still fit there: KV
        caches compress, and the file is what takes the room. Tried once a pass (it costs a
        compression) while the room holds a block; ``otherwise`` the victim goes where it was placed."""
        disk = self.agent.disk
        if tier != TierKind.HOST or disk is None or state.demote_failed or state.tried_tight_disk:
            return otherwise
        if disk.room() < disk.block_bytes:  # none while its writes fail (DiskTier.room)
            return otherwise
        state.tried_tight_disk = True
        done = self.moves.demote_to_disk(job.victim, job.offset)
        if done:
            return Move(kind=MoveKind.DEMOTE, tier=TierKind.DISK)
        state.demote_failed = done is Demotion.FAILED
        return otherwise

    def room_below(self, lower: TierKind | None) -> int:
        """Room in this agent's next tier down: the disk's free bytes, or the host tier's room under
        its high watermark (a demotion from the GPU must not put the host tier under pressure)."""
        agent = self.agent
        if lower == TierKind.DISK and agent.disk is not None:
            # Less the room promised to peers' files on the wire; none while its writes fail.
            return agent.disk.room()
        if lower == TierKind.HOST:
            used, _, _, _ = agent.table.usage()
            return max(0, int(agent.config.high_watermark * agent.table.capacity_bytes) - used)
        return 0


def peer_target(
    agent: Agent,
    job: SpillJob,
    source: TierKind,
    targets: tuple[TierKind, ...],
    peers: list[NodeInfo],
    now_ms: int,
    planned: dict[TierKind, dict[str, int]],
    refused: Collection[str],
    holders: list[NodeInfo],
    *,
    fill_mark: Callable[[NodeInfo], float] | None = None,
    in_pieces_last: bool = False,
) -> tuple[str, TierKind, SpillJob] | None:
    """The first of ``targets`` that a peer has room in for ``job`` (in ``source`` here), the peer,
    and the job as it goes there (in the form that tier keeps). ``planned``: what was planned into
    each tier of each peer so far; ``refused``: peers that are no destination; ``holders``: the
    nodes of the object's other copies; ``fill_mark``: what share of a peer's tier it may fill
    (policy/eviction.py: choose_move, as ``in_pieces_last``)."""
    for tier in targets:
        sent = job if tier == source else as_other_tier(job, tier)
        move = choose_move(
            sent.room_bytes,
            tier=tier,
            node_id=agent.node_id,
            zone=agent.config.zone,
            lower_tier=None,
            lower_free_bytes=0,
            peers=peers,
            now_ms=now_ms,
            high_watermark=agent.config.high_watermark,
            planned_bytes=planned.setdefault(tier, {}),
            refused=refused,
            stored_bytes=sent.stored_bytes,
            holders=holders,
            plain_bytes=job.victim.size_bytes,
            fill_mark=fill_mark,
            in_pieces_last=in_pieces_last,
        )
        if move.kind == MoveKind.SPILL and move.node_id is not None:
            return move.node_id, tier, sent
    return None
