"""Memory pressure: the agent's loop that keeps each tier under its high watermark.

Each pass asks the pure policy (policy/eviction.py) what to move and where, then carries the moves
out, each one as DESIGN.md §3.4 wants: copy the bytes, compare-and-swap the location in the index,
and only then let the old copy go (through the graveyard, so a reader that still holds a lease on
the object keeps reading whole bytes). Spills are planned during a pass and then carried out per
peer in batches (agent/spill.py): one reservation, the writes, and one compare-and-swap per batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from mooncake_store.agent.compaction import Compactor
from mooncake_store.agent.drains import Drains, RoomRequests
from mooncake_store.agent.evicting import Evictions
from mooncake_store.agent.failure_log import FailureLog
from mooncake_store.agent.moves import LocalMoves
from mooncake_store.agent.placing import PassState, Placer, Spills
from mooncake_store.agent.promotions import PromotionQueue
from mooncake_store.agent.repairs import REPAIR_EVERY_S, Repairs
from mooncake_store.agent.spill import Spiller, SpillJob
from mooncake_store.agent.spill_jobs import SilentPeers
from mooncake_store.errors import MooncakeError
from mooncake_store.policy.eviction import MoveKind, choose_victims, eviction_order
from mooncake_store.transport import frames
from mooncake_store.types import EvictionCandidate, TierKind

if TYPE_CHECKING:
    from mooncake_store.agent.allocations import AllocationTable
    from mooncake_store.agent.node import Agent

log = logging.getLogger("mooncake.agent")

#: Objects sampled from the index per pass.
SAMPLE = 256
#: Passes in a row while each one still moves something.
MAX_PASSES = 32
#: How long a peer that has the bytes for this node's victims in pieces too small for them may hold
#: those victims back while it compacts its arena for them (its refusals in a row, each within
#: twice this of the one before): a peer whose compaction makes no block by then no longer does,
#: and the victims with nowhere else to go are evicted as before.
PIECES_WAIT_S = 5.0
#: How often, while peers' arenas are mapped, the node table is read to unmap those that left.
RETAIN_EVERY_S = 2.0
#: Peers asked per victim in a pass: a peer that refuses is left out and the next one asked.
PEER_TRIES = 3

#: Locates a victim in its tier here (None: freed since the sample was taken).
JobOf = Callable[[EvictionCandidate], SpillJob | None]


@dataclass(frozen=True, slots=True)
class Returning:
    """Bytes of a tier that the graveyard gives back by itself: all of them, and those due soon;
    and the index's time when it was read (ms)."""

    all: int = 0
    soon: int = 0
    now_ms: int = 0
    due: int = 0  # of those, due already (their leases over): a reclaim frees them now


class PressureManager:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.counters: dict[TierKind, Counter[str]] = {t: Counter() for t in TierKind}
        #: When (monotonic s) the loop next lets go of peers that left (_retain_peers).
        self._next_retain = 0.0
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._spiller = Spiller(agent)
        self.silent = SilentPeers(agent.config.heartbeat_ttl_s)
        #: Per peer refusing this node's victims for room in pieces: (the first refusal of the run,
        #: the last), monotonic s; gone once a spill to it moves something (PIECES_WAIT_S).
        self._compacting: dict[str, tuple[float, float]] = {}
        self.moves = LocalMoves(agent, self.count)
        self.placer = Placer(agent, self.moves)
        self.requests = RoomRequests()
        self.drains = Drains(agent.config)
        self.evictions = Evictions(agent, self.moves, self.drains, self._bytes_in)
        self.compactor = Compactor(agent, self.moves)
        # A promotion under way when the agent stops may wait out one index call before its arena goes.
        self.promotions = PromotionQueue(self.moves, join_s=agent.index_timeout_s + 1.0)
        job_of = {TierKind.HOST: self._host_job, TierKind.GPU: self._gpu_job, TierKind.DISK: self._disk_job}
        self.repairs = Repairs(agent, self._spiller, job_of, self.count, self.silent.note, self.moves.resolve)

    def close(self) -> None:
        self.promotions.close()
        self._spiller.close()

    # ---- signals from the server ------------------------------------------------------------
    def want_room(self, blocks: Sequence[int], *, tier: TierKind = TierKind.HOST, spared_peers: int = 0) -> None:
        """A reservation of ``blocks`` (its requests' footprints) did not fit: make room now rather
        than at the next pass.
        One larger than the whole tier can never fit, and makes none: a pass sized by it would move
        or evict everything there (one hostile RESERVE frame would empty the node).
        ``spared_peers``: the marks of the nodes where the writer's put keeps its other replicas
        (frames.spared_peers), whose room a spill there would take."""
        table = self.agent.gpu_table if tier == TierKind.GPU else self.agent.table
        if table is None or sum(blocks) > table.capacity_bytes:
            return
        self.requests.refused(tier, tuple(blocks), spared_peers)  # before the wake: it ends the loop's hold
        self._wake.set()

    def want_blocks(self, blocks: list[int]) -> None:
        """A host reservation of ``blocks`` (footprints) was refused while the arena had the bytes
        free, in pieces: the loop compacts the arena (agent/compaction.py) before its passes."""
        self.compactor.want_blocks(blocks)
        self._wake.set()

    def writer_may_wait(self, tier: TierKind = TierKind.HOST) -> bool:
        """Whether a reservation in ``tier`` was refused within drains.WRITER_WAITS_S: its writer may be
        waiting for the room the passes make, which a promotion must not take. Promoted as each
        block was freed, a reader's disk objects came back into the room a put waited for, and the
        put waited out its timeout while the node demoted and promoted the same objects."""
        return self.requests.writer_may_wait(tier)

    def _relieve_arena(self, tier: TierKind, table: AllocationTable, job_of: JobOf) -> int:
        """A pass over an arena tier (host or GPU), sized for the reservations waiting for room."""
        wanted, spared = self.requests.take(tier)
        try:
            # For a replicated put's writer the room is made by spills to the other peers only,
            # else by demotion or eviction: spilled to the peers its other replicas need room on,
            # each agent asked in turn spilled the same objects back, and the put waited out its
            # timeout while the cluster's use stood still.
            moved = self._relieve(tier, self._arena_need(tier, table, wanted), job_of, spared_peers=spared)
        except BaseException:
            # A failed pass made no room: the writer is still waiting, and the next pass must
            # know it before that writer's next refused RESERVE tells it again.
            self.requests.note(tier, wanted, spared)
            raise
        if moved and not table.fits(wanted):
            # The pass moved less than the writer waits for (its sample ran short of movable
            # objects): the next pass of this wake must still make room for it, not only drain to
            # the watermark (one pass per refused RESERVE, each after the writer's back-off).
            # A pass that moved nothing ends the wake's passes, and with them the request.
            self.requests.note(tier, wanted, spared)
        return moved

    def wake(self) -> None:
        """A reservation took the tier past its high watermark. Right after a pass that found
        nothing movable (everything hot or pinned), the wakes within drains.FRUITLESS_RETRY_S are one
        pass at its end (run): a writer filling such a node would otherwise cost the index a
        victim sample per put. They were dropped, so pins released just after a fruitless pass
        waited for the next interval (0.2 s) before anything moved."""
        self._wake.set()

    def count(self, tier: TierKind, name: str, n: int = 1) -> None:
        with self._lock:  # server threads, the pressure thread and the sync all count
            self.counters[tier][name] += n

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        interval = self.agent.config.pressure_interval_s
        next_repair = 0.0
        failures = FailureLog(log, "pressure pass")
        while not stop.is_set():
            self._wake.wait(interval)
            # Right after a fruitless pass, wait out its retry; the wakes meanwhile are this one
            # pass. A reservation that did not fit (a wanted size, noted before its wake) ends the
            # wait. Cleared before the state is read, so no wake falls between the two.
            while not stop.is_set():
                self._wake.clear()
                hold = self.drains.hold_s()
                if hold <= 0 or self.requests.pending() or self.compactor.pending():
                    break
                self._wake.wait(hold)
            if stop.is_set():
                return
            # Each duty fails on its own: one that raised at every turn (a victim sample the index
            # refuses, a record no check foresaw) skipped the duties after it, the repairs of
            # objects a dead node left short of copies among them, for as long as it failed.
            # The passes wait for the moves of unknown outcome to be settled (their copies' room).
            failed = not self._duty(self._retain_peers, failures)
            if self._duty(self.moves.settle, failures):
                # Before the passes: a block joined inside the arena is room no object leaves for.
                failed = not self._duty(partial(self._compact, stop), failures) or failed
                for relieve in (self.relieve_gpu, self.relieve_host, self.relieve_disk):
                    if stop.is_set():
                        return
                    failed = not self._duty(partial(self._relieve_all, relieve, stop), failures) or failed
            else:
                failed = True
            if stop.is_set():
                return
            if time.monotonic() >= next_repair:  # objects a dead node's loss left short of copies
                next_repair = time.monotonic() + REPAIR_EVERY_S
                failed = not self._duty(partial(self.repairs.run_once, self.silent.now()), failures) or failed
                if self.repairs.more:
                    next_repair = 0.0
                    self._wake.set()
            if not failed:
                failures.succeeded()

    def _compact(self, stop: threading.Event) -> None:
        """The compaction duty: blocks kept for peers, held windows let go once joined, and the
        blocks a refused reservation asked for (agent/compaction.py)."""
        self.compactor.keep_blocks()
        self.compactor.settle()
        if self.compactor.pending():
            self.compactor.run_once(stop)

    def _duty(self, duty: Callable[[], object], failures: FailureLog) -> bool:
        """Run one duty of a pass; False when it failed (logged)."""
        try:
            duty()
        except MooncakeError as exc:
            failures.failed(exc)
            return False
        except Exception:
            # A bug, or a record no check foresaw: this duty's turn is lost, not the node's
            # eviction for the rest of its life (the thread would end and nothing would ever move).
            log.exception("pressure pass failed unexpectedly")
            return False
        return True

    def _retain_peers(self) -> None:
        spiller = self._spiller
        if (spiller.arenas.mapped or spiller.transport.pooled) and time.monotonic() >= self._next_retain:
            # Same-host peers' arenas stay mapped between passes, and peers' connections pooled:
            # one that left must not keep its memory allocated until this node is under pressure
            # again, nor its connections open for good.
            self._next_retain = time.monotonic() + RETAIN_EVERY_S
            peers = list(self.agent.index.nodes().values())
            spiller.arenas.retain(peers)
            spiller.transport.retain({peer.tcp_endpoint for peer in peers})

    @staticmethod
    def _relieve_all(relieve: Callable[[], int], stop: threading.Event) -> None:
        """Passes of one tier while they make progress: evicting a chain's last chunk makes its
        parent a leaf only then, so one sample can free little. Each pass ends before the next is
        begun once the agent stops: stop() waits a few seconds for this thread, then tears down
        what a pass would still use."""
        for _ in range(MAX_PASSES):
            if stop.is_set() or relieve() == 0:
                break

    def relieve_host(self) -> int:
        """One pass over the host tier; returns the bytes moved away."""
        return self._relieve_arena(TierKind.HOST, self.agent.table, self._host_job)

    def _arena_need(
        self, tier: TierKind, table: AllocationTable, wanted: tuple[int, ...]
    ) -> Callable[[Returning], int]:
        """What must leave an arena tier (host or GPU), with the blocks ``wanted`` of a reservation
        that did not fit waiting for room."""

        def need_now(returning: Returning) -> int:
            used, _, largest_free, _ = table.usage()
            # The pieces of windows a compaction holds until their old blocks join them: room on
            # its way, not use (counted as used, a pass evicted for a writer whose block was
            # being made, and a drain started on their account).
            compacting = self.compactor.held_bytes() if tier == TierKind.HOST else 0
            # 0: room for it appeared meanwhile (a piece for each of its blocks: checked against the
            # largest piece alone, a batch whose blocks a compaction had just made had the pass
            # evict the batch's sum all the same), or a compaction is making it.
            waiting = 0 if compacting or table.fits(wanted) else sum(wanted)
            # Memory held for readers of objects the index lost (an index restarted empty or
            # rolled back) comes back by itself, like a grave's: counted as used, it had the
            # objects put after the restart evicted for it.
            held, held_soon = table.held_bytes(self.agent.config.pressure_interval_s)
            need = self.drains.need(tier, used - returning.all - held - compacting, table.capacity_bytes, waiting)
            # The free space may be in pieces too small for the waiting reservation. A writer waits
            # a few seconds at most: only graves and holds due by the next pass count as room for
            # it (a long read lease on a removed object must not leave it waiting while others
            # could move).
            return max(need, waiting - largest_free - returning.soon - held_soon) if waiting else need

        return need_now

    def _relieve(
        self, tier: TierKind, need_now: Callable[[Returning], int], job_of: JobOf, *, spared_peers: int = 0
    ) -> int:
        """The pass shared by every tier: ``need_now(returning)`` is what must leave ``tier``, given
        ``returning`` bytes of it that come back by themselves. Space of removed, replaced and moved
        objects is freed once their read leases end: free what is due now, and do not move live
        objects out for what is merely waiting."""
        if need_now(Returning()) <= 0:
            return 0
        self.agent.reclaim_now()
        returning = self._returning(tier)
        need = need_now(returning)
        if need <= 0 and returning.due:
            # The room is in graves due now, which the reclaim above left (it runs at most once
            # per RECLAIM_MIN_INTERVAL_S unforced): free them now, not at the next sync, so that
            # a waiting writer finds its room.
            self.agent.reclaim_now(force=True)
        return self._walk(tier, need, job_of, now_ms=returning.now_ms, spared_peers=spared_peers) if need > 0 else 0

    def _returning(self, tier: TierKind) -> Returning:
        """Bytes of ``tier`` held by this node's graveyard (still leased: freed when leases end),
        all of them and those due by the next pass."""
        agent = self.agent
        now_ms, graves = agent.index.pending_graves(agent.node_id)
        soon_ms = now_ms + int(1000 * agent.config.pressure_interval_s)
        return Returning(
            all=self._bytes_in(tier, [g for g, _ in graves]),
            soon=self._bytes_in(tier, [g for g, due in graves if due <= soon_ms]),
            now_ms=now_ms,
            due=self._bytes_in(tier, [g for g, due in graves if due <= now_ms]),
        )

    def _bytes_in(self, tier: TierKind, alloc_ids: list[int]) -> int:
        """What those of ``alloc_ids`` that live in ``tier`` here take there (stored bytes on disk)."""
        agent = self.agent
        if tier == TierKind.DISK:
            disk = agent.disk
            return sum(e.footprint_bytes for a in alloc_ids if (e := disk.entry(a)) is not None) if disk else 0
        table = agent.gpu_table if tier == TierKind.GPU else agent.table
        return table.bytes_of(alloc_ids) if table is not None else 0

    def _host_job(self, victim: EvictionCandidate) -> SpillJob | None:
        location = self.agent.table.offset_of(victim.alloc_id)
        return SpillJob(victim=victim, offset=location[0]) if location is not None else None

    def _walk(self, tier: TierKind, need: int, job_of: JobOf, *, now_ms: int, spared_peers: int = 0) -> int:
        """Move the coldest movable objects of ``tier`` until ``need`` bytes are on their way out;
        returns the bytes moved. ``job_of`` locates a victim in the tier (None: freed since the
        sample was taken); ``now_ms``: the index's time as the pass began (read with the graveyard);
        ``spared_peers``: the marks of peers nothing goes to (frames.spared_peers: all of them, and
        what is not demoted here is evicted)."""
        agent = self.agent
        candidates = agent.index.victim_candidates(agent.node_id, str(tier), sample=SAMPLE)
        # One read of the node table per pass; what this pass sends each peer is counted here.
        peers = list(agent.index.nodes().values()) if agent.config.spill_to_peers else []
        if tier == TierKind.HOST:
            self._spiller.arenas.premap(peers)  # also unmaps peers that left
        else:
            self._spiller.arenas.retain(peers)
        # Spared peers are no destination, but stay known: an object's other copy on one of them
        # still spreads this one's move to another host and zone (placing.Placer.place's holders).
        spared = {p.node_id for p in peers if spared_peers & frames.replica_peer_bit(p.node_id)}
        state = PassState(peers=peers, refused=self.silent.now() | spared, sampled_ms=now_ms)
        # Spills are planned during the walk and carried out afterwards, batched per peer
        # (agent/spill.py); demotions happen as the walk meets them, evictions are queued and sent
        # in batches (Evictions.evict_queued).
        moved = 0
        # Walk the whole cold-first order: a victim that may not leave (pinned or read since, or a
        # chain chunk whose chain cannot go) is passed over, not the end of the pass. A victim with
        # nowhere to go is evicted only if those that can move (demoted or spilled) fall short:
        # evicted as the walk met it, a replicated put's writer, whose room spares the peers of
        # the put's other replicas, had the other copies of replicated objects dropped (their
        # one other peer spared, their holder no destination) while cold objects could spill.
        homeless: list[SpillJob] = []
        waiting = 0  # victims' room that waits for a peer's compaction (PIECES_WAIT_S)
        order = iter(choose_victims(candidates, need_bytes=sum(c.size_bytes for c in candidates), now_ms=now_ms))
        while True:
            spills: Spills = {}
            planned = 0
            while moved + waiting + planned < need and (victim := next(order, None)) is not None:
                job = job_of(victim)
                if job is None:
                    continue
                move = self.placer.place_demoting(job, now_ms, state, tier)
                if move.kind == MoveKind.DEMOTE:
                    moved += job.room_bytes
                elif move.kind == MoveKind.SPILL and move.node_id is not None:
                    state.spill(spills, job, move, tier)
                    planned += job.room_bytes
                else:
                    homeless.append(job)
            if not spills:
                break  # the order is walked, or the room is made
            # Victims whose peers all refused them (filled since the node table was read) are
            # homeless too, and the walk goes on to warmer ones that can move: evicted at once,
            # a node spilling to the one peer with room dropped its copies of objects whose
            # other copy sat there (no destination) while its other objects could go there.
            carried, stranded, held = self._carry_out_spills(spills, now_ms, state, tier, job_of)
            moved += carried
            waiting += held
            homeless.extend(stranded)
        # The last copies of objects a node's death left short go last (their repair may not have
        # run yet): cold-first alone, a survivor lost them while warmer single copies stayed.
        homeless = eviction_order(homeless, lambda job: job.victim)
        moved = self.evictions.evict_until(homeless, state, tier, moved=moved + waiting, need=need) - waiting
        if moved + waiting < need and state.touched:
            # Recency is a preference, not a veto: with the rest gone or refused, the victims
            # accessed since the pass began go too, coldest first by the sample (a live lease or a
            # pin still keeps one). Refused for good, a node whose every object was read while a
            # writer waited made its room two to three times slower, in passes that backed off.
            again = eviction_order(state.touched, lambda job: job.victim)
            state.touched, state.sampled_ms = [], None
            moved = self.evictions.evict_until(again, state, tier, moved=moved + waiting, need=need) - waiting
        if moved:
            # The old copies sit in the graveyard, due now (a victim's lease had run out): free
            # them at once rather than at the next sync tick, so a waiting writer gets its room.
            agent.reclaim_now(force=True)
            self.drains.moved(tier)
        else:
            self.drains.fruitless(tier)  # nothing movable now: the drain goes on, backing off
        return moved

    def _carry_out_spills(
        self,
        spills: Spills,
        now_ms: int,
        state: PassState,
        tier: TierKind,
        job_of: JobOf,
    ) -> tuple[int, list[SpillJob], int]:
        """Send each peer its victims in batches (to the peer's tier each was planned into). A peer
        that refuses is skipped for the rest of the pass in that tier (one that breaks or does not
        answer, in all of them), and what it did not take is placed again: another peer or tier,
        else demoted. Returns the room made here, the victims left with nowhere to go (the walk
        evicts them only if warmer ones cannot make the room), and the room of those left here
        for the next pass while a peer compacts for them (PIECES_WAIT_S)."""
        moved = waiting_bytes = 0
        stranded: list[SpillJob] = []
        for attempt in range(PEER_TRIES):
            retry: list[SpillJob] = []
            write_refused: set[int] = set()
            compacting: set[int] = set()
            for (node_id, target), jobs in spills.items():
                if node_id in state.refused_in(target):
                    # Broke on another of its tiers in this pass (the cross-tier fallback plans
                    # one peer's host and disk tiers both): a hung peer asked again cost the pass
                    # its timeout once more. Or planned into this tier before it refused it here.
                    # Placed again with the rest.
                    state.plan(node_id, jobs, target, sign=-1)
                    retry.extend(jobs)
                    continue
                result = self._spiller.spill(state.by_id[node_id], jobs, tier=target, source=tier)
                unreachable = self._spiller.take_unreachable()
                self.silent.note(unreachable)
                moved += sum(state.room_here.get(job.victim.alloc_id, job.room_bytes) for job in result.moved)
                if result.moved:
                    self.count(tier, "spills_out", len(result.moved))
                if result.unknown:
                    # Swaps whose answer was lost may have landed: counted once the index says so,
                    # now or at a later settle() (the old copies are then in the graveyard).
                    self.moves.resolve([target for _, target in result.unknown])
                if result.error is not None:
                    raise result.error  # the index failed: end the pass (run() logs it)
                if result.refused:
                    state.turned_down(node_id, target, unreachable=node_id in unreachable)
                if result.moved:
                    self._compacting.pop(node_id, None)  # it took some: a run of refusals starts anew
                if result.in_pieces and self._waits_for(node_id):
                    compacting |= result.in_pieces
                if result.unsent:  # refused in part (the peer still asked), or with the rest
                    state.plan(node_id, result.unsent, target, sign=-1)
                    retry.extend(result.unsent)
                    write_refused |= result.write_refused
            spills = {}
            for unsent in retry:
                job = job_of(unsent.victim)  # located afresh: where it is now, and its size there
                if job is None:
                    continue  # freed meanwhile
                move = self.placer.place_demoting(job, now_ms, state, tier)
                if move.kind == MoveKind.DEMOTE:
                    moved += job.room_bytes
                    continue
                if move.kind == MoveKind.SPILL and move.node_id is not None and attempt + 1 < PEER_TRIES:
                    state.spill(spills, job, move, tier)
                    continue
                if unsent.victim.alloc_id in compacting:
                    # Its peer has the room in pieces and is compacting for it (the refusal asked
                    # it to): left here for the next pass, its room counted as on its way, so
                    # that the pass evicts nothing in its stead meanwhile.
                    waiting_bytes += job.room_bytes
                    continue
                if unsent.victim.alloc_id in write_refused or unsent.victim.survivor:
                    # Refused at its WRITE after the peer reserved room (a moment's refusal, a
                    # reservation timed out under load): left where it is for the next pass, not
                    # evicted for it (a failing disk's RESERVEs are refused by then: tiers/disk.py).
                    # So is the last copy of an object a node's death left short: evicted here, it
                    # went before the pass's other homeless victims (eviction_order).
                    continue
                stranded.append(job)  # out of peers to ask, or none has room
            if not spills:
                break
        return moved, stranded, waiting_bytes

    def _waits_for(self, node_id: str) -> bool:
        """A peer refused victims for room in pieces: whether they may still wait for its
        compaction (PIECES_WAIT_S from the first of its refusals in a row)."""
        now = time.monotonic()
        first, last = self._compacting.get(node_id, (now, now))
        if now - last > 2 * PIECES_WAIT_S:
            first = now  # a refusal long after the last one starts a run of its own
        self._compacting[node_id] = (first, now)
        return now - first < PIECES_WAIT_S

    def relieve_gpu(self) -> int:
        """One pass over the GPU tier: the coldest objects go to host memory (one device-to-host
        copy each) while the host tier stays under its high watermark, else to the GPU tier of the
        peer with the most room there (same zone first), else they are evicted."""
        agent = self.agent
        table = agent.gpu_table
        if table is None or agent.gpu is None:
            return 0
        return self._relieve_arena(TierKind.GPU, table, self._gpu_job)

    def _gpu_job(self, victim: EvictionCandidate) -> SpillJob | None:
        table = self.agent.gpu_table
        location = table.offset_of(victim.alloc_id) if table is not None else None
        return SpillJob(victim=victim, offset=location[0]) if location is not None else None

    def relieve_disk(self) -> int:
        """One pass over the disk tier: the coldest chunk files go to the peer with the most room on
        its disk tier (same zone first), else they are evicted. A file sends its stored bytes and
        frees the filesystem blocks it takes (DiskTier.footprint)."""
        agent = self.agent
        disk = agent.disk
        if disk is None:
            return 0

        def need_now(returning: Returning) -> int:
            return self.drains.need(TierKind.DISK, disk.used_bytes - returning.all, disk.capacity_bytes)

        return self._relieve(TierKind.DISK, need_now, self._disk_job)

    def _disk_job(self, victim: EvictionCandidate) -> SpillJob | None:
        disk = self.agent.disk
        entry = disk.entry(victim.alloc_id) if disk is not None else None
        # A file sends its stored (compressed) bytes, and its leaving frees the blocks it takes.
        # One dropped as damaged (a peer refused it, and the check here found why) goes nowhere:
        # placed again, it had the peer refuse the pass's other victims, which were evicted.
        if entry is None or victim.alloc_id in self.agent.damaged_disk_ids:
            return None
        return SpillJob(victim=victim, offset=0, stored_bytes=entry.stored_bytes, footprint_bytes=entry.footprint_bytes)
