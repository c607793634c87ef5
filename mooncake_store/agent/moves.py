"""Moves of one object inside this agent, each as DESIGN.md §3.4 wants (copy the bytes,
compare-and-swap the location in the index, then let the old copy go through the graveyard):
demotion from host memory to disk and from the GPU to host memory, promotion from disk back to
host memory, and eviction. The pressure loop (pressure.py) decides which objects move; this
module moves them."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from mooncake_store.errors import MooncakeError, NoCapacity
from mooncake_store.types import EvictionCandidate, Replica, ReplicaState, TierKind

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent

log = logging.getLogger("mooncake.agent")

#: A pass that could move nothing else evicts at most this many chain chunks kept for their later
#: chunks (the coldest), in one index call...
CHAIN_VICTIMS = 64
#: ... each with at most this many later chunks: a chunk near the head of a long chain is not
#: worth the chain (its later chunks elsewhere would go for the room of one chunk here).
MOST_LATER_CHUNKS = 64


class CountMove(Protocol):
    """Adds ``n`` to the counter ``name`` of ``tier`` (PressureManager.count)."""

    def __call__(self, tier: TierKind, name: str, n: int = 1) -> None: ...


#: A move's counter: (tier, name), counted once the index is known to name the move's target.
Counted = tuple[TierKind, str]


class Demotion(Enum):
    """How a demotion to disk ended; true only when it was done. The pressure pass tells the
    failures apart: only a disk whose writes fail counts as full for the rest of the pass (a file
    that did not fit, or an object that changed meanwhile, says nothing of the next victim)."""

    DONE = "done"
    NO_ROOM = "no room"  # the file did not fit in the disk's free room
    LOST = "lost"  # the object changed meanwhile: the index names another location
    FAILED = "failed"  # the file could not be written

    def __bool__(self) -> bool:
        return self is Demotion.DONE


@dataclass(frozen=True, slots=True)
class MoveTarget:
    """Where a move put an object's new copy: allocation ``alloc_id`` of node ``node_id`` (this
    agent for a local move, the peer for a spill) in ``tier``; ``counted`` is what the move adds
    to once the index is known to name it."""

    key: str
    node_id: str
    alloc_id: int
    tier: TierKind
    counted: Counted


class MovesGate:
    """Moves of this node's own objects (a demotion, a promotion: a target filled here, then
    swapped in the index) against the reconcile after an index rollback, which dooms what the
    index does not name: a target filled but not yet swapped when the index was read was doomed,
    the swap landed after, and the index named memory freed a lease later. Moves go on together;
    the reconcile waits for those under way and holds new ones back until it is done."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._moving = 0
        self._reconciling = False

    @contextlib.contextmanager
    def move(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._reconciling)
            self._moving += 1
        try:
            yield
        finally:
            with self._cond:
                self._moving -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def reconciling(self) -> Iterator[None]:
        with self._cond:
            self._reconciling = True
            self._cond.wait_for(lambda: self._moving == 0)
        try:
            yield
        finally:
            with self._cond:
                self._reconciling = False
                self._cond.notify_all()


class LocalMoves:
    def __init__(self, agent: Agent, count: CountMove) -> None:
        self.agent = agent
        self.count = count
        #: Move targets whose swap's outcome the index could not tell, by (node id, alloc id):
        #: settle() asks again and counts those it names; of the rest it frees this agent's own
        #: (a spill's target on a peer is the peer's to free: its sync finds no ack for it).
        self._unsure: dict[tuple[str, int], MoveTarget] = {}
        self._lock = threading.Lock()
        self.gate = MovesGate()

    def demote_to_disk(self, victim: EvictionCandidate, offset: int) -> Demotion:
        """Compress a host-tier object (at ``offset`` in the arena) into a chunk file of this agent's
        disk tier and swap it there; the file is dropped unless the index names it afterwards."""
        with self.gate.move():
            return self._demote_to_disk(victim, offset)

    def _demote_to_disk(self, victim: EvictionCandidate, offset: int) -> Demotion:
        agent = self.agent
        assert agent.disk is not None
        disk_id = agent.table.new_id()
        view = agent.arena.view(offset, victim.size_bytes)
        try:
            agent.disk.write(disk_id, view, itemsize=agent.itemsize_of(victim.dtype))
        except NoCapacity as exc:
            log.debug("demotion of %s did not fit: %s", victim.key, exc)
            return Demotion.NO_ROOM
        except MooncakeError as exc:
            # A disk that cannot be written is an operator's problem, not a cache's routine.
            log.warning("demotion of %s failed: %s", victim.key, exc)
            return Demotion.FAILED
        finally:
            view.release()
        # Known before the swap: a sync that frees the file (as a grave) must find it.
        agent.disk_keys[disk_id] = victim.key
        # A disk allocation is read whole, from its file: offsets count from its start.
        swapped = self._swap_into(
            victim.key, victim.alloc_id, TierKind.DISK, 0, disk_id, victim.size_bytes, (TierKind.HOST, "demotions")
        )
        return Demotion.DONE if swapped else Demotion.LOST

    def _swap_into(
        self,
        key: str,
        old_alloc_id: int,
        tier: TierKind,
        offset: int,
        alloc_id: int,
        size_bytes: int,
        counted: Counted,
        promotion: bool = False,
    ) -> bool:
        """Swap an object of this agent into a target of ``tier`` here that it already filled (a
        committed host block, a chunk file); the target is dropped unless the index names it
        afterwards, whatever the swap raised. The move is counted (``counted``) once the index is
        known to name the target."""
        try:
            swapped = self._swap(
                key,
                old_alloc_id=old_alloc_id,
                node_id=self.agent.node_id,
                tier=tier,
                offset=offset,
                size_bytes=size_bytes,
                alloc_id=alloc_id,
                promotion=promotion,
            )
            if swapped:
                self.count(*counted)
        except MooncakeError:  # unknown whether the swap landed: ask the index (or settle() will)
            swapped = None
        if not swapped:
            # A refusal may be the answer of a replay: the call is retried after a broken
            # connection, and a first run that landed, with the object removed since (under a
            # reader's lease on the target), is answered GONE the second time. Whether the target
            # is named, buried or recorded as landed decides, not the answer (_keep).
            target = MoveTarget(key, self.agent.node_id, alloc_id, tier, counted)
            swapped = self.resolve([target]).get(target, True)  # unsure: kept for settle()
        if not swapped:
            self._drop_target(alloc_id, tier)
        return swapped

    def resolve(self, targets: list[MoveTarget]) -> dict[MoveTarget, bool]:
        """For move targets whose swap's outcome is unknown (its call and the retry failed):
        whether each landed (see _keep), and those that did are counted. A target the index cannot
        answer for now is left out of the answer and remembered for settle(), which counts it once
        it learns that the move landed. A caller keeps its own target while unsure: dropping it
        under a live replica would lose data, keeping it for nothing only leaks it until then."""
        landed = self._keep(targets)
        for target, keep in landed.items():
            if keep:
                self.count(*target.counted)
        with self._lock:
            for target in targets:
                if target not in landed:
                    self._unsure[(target.node_id, target.alloc_id)] = target
        return landed

    def _keep(self, targets: list[MoveTarget]) -> dict[MoveTarget, bool]:
        """For move targets whose swap's outcome is unknown, whether each landed and must be kept:
        its key's record lists it (an object's replica like any other), or it is in its node's
        graveyard (the swap landed and the object was removed or replaced since, perhaps under a
        reader's lease: that node's sync frees it when the leases end), or the index recorded the
        swap (landed:<this node>, kept LANDED_KEEP_MS: the object removed and its grave freed
        since; asked only after that window, with the index out of reach longer, such a swap is
        taken for one that never landed: its counter misses it). None of these: the swap never
        landed. Only the targets the index could answer for; the questions go first, then the
        graveyards and the record of swaps, so that a burial between the reads is seen."""
        named: dict[MoveTarget, bool] = {}
        for target in targets:
            answer = self._ask_index(target)
            if answer is None:
                break  # unreachable: the rest wait for the next time
            named[target] = answer
        unnamed: dict[str, list[int]] = {}
        for target, answer in named.items():
            if not answer:
                unnamed.setdefault(target.node_id, []).append(target.alloc_id)
        landed: set[tuple[str, int]] = set()  # unnamed, but in a graveyard or the record of swaps
        try:
            for node_id, alloc_ids in unnamed.items():
                landed.update((node_id, a) for a in self.agent.index.buried(node_id, alloc_ids))
            # Removed and freed since (its grave drained by that node's sync): the index's record
            # of the swap itself, kept for a while, says it landed.
            left = [(n, a) for n, ids in unnamed.items() for a in ids if (n, a) not in landed]
            landed.update(self.agent.index.landed(self.agent.node_id, left))
        except MooncakeError:
            return {}
        return {t: n or (t.node_id, t.alloc_id) in landed for t, n in named.items()}

    def _ask_index(self, target: MoveTarget) -> bool | None:
        """Whether the target's key lists it; None when the index cannot be asked. The record
        itself, not a lookup: a lookup leaves out nodes past their heartbeat deadline, which this
        one may be right after the outage that made the question necessary."""
        try:
            replicas = self.agent.index.replicas_listed(target.key)
        except MooncakeError:
            return None
        return replicas is not None and any(
            r.node_id == target.node_id and r.alloc_id == target.alloc_id for r in replicas
        )

    def _drop_target(self, alloc_id: int, tier: TierKind) -> None:
        """Free a move's target that the index does not name: a chunk file, or a host block."""
        agent = self.agent
        if tier == TierKind.DISK:
            agent.disk_keys.pop(alloc_id, None)
            if agent.disk is not None:
                agent.disk.remove(alloc_id)
        else:
            agent.table.free([alloc_id])

    def settle(self) -> int:
        """Ask the index again about targets kept while it could not answer: count those it names,
        free this agent's own that it does not (_keep). Returns how many were freed. The pressure
        loop calls this before each pass."""
        with self._lock:
            unsure = list(self._unsure.values())
        if not unsure:
            return 0
        freed = 0
        for target, keep in self._keep(unsure).items():
            with self._lock:
                self._unsure.pop((target.node_id, target.alloc_id), None)
            if keep:
                self.count(*target.counted)
            elif target.node_id == self.agent.node_id:
                self._drop_target(target.alloc_id, target.tier)
                freed += 1
        return freed

    def _swap(
        self,
        key: str,
        *,
        old_alloc_id: int,
        node_id: str,
        tier: TierKind,
        offset: int,
        size_bytes: int,
        alloc_id: int,
        promotion: bool = False,
    ) -> bool:
        """Compare-and-swap one of this agent's replicas of ``key`` to the new location (which its
        agent learns of through its ack list); False when the object moved, went or is pinned."""
        new = Replica(
            node_id=node_id,
            tier=tier,
            offset=offset,
            size_bytes=size_bytes,
            alloc_id=alloc_id,
            state=ReplicaState.COMPLETE,
        )
        status = self.agent.index.move_replica(
            key, old_node=self.agent.node_id, old_alloc_id=old_alloc_id, new=new, promotion=promotion
        )
        return status == "OK"

    def evict_many(
        self,
        victims: list[EvictionCandidate],
        tier: TierKind,
        *,
        since_ms: int | None = None,
        touched: set[int] | None = None,
    ) -> list[bool]:
        """Drop these replicas of ``tier`` in one index round trip, in order; per victim whether it
        went (not pinned, read, replaced or cut from its chain since the sample chose it, nor
        accessed after ``since_ms``: the index's time when that sample was taken; the alloc ids of
        those refused for that alone are added to ``touched``)."""
        if not victims:
            return []
        statuses = self.agent.index.evict_many(
            [(v.key, v.alloc_id) for v in victims], node_id=self.agent.node_id, since_ms=since_ms
        )
        if touched is not None:
            touched.update(v.alloc_id for v, status in zip(victims, statuses, strict=True) if status == "TOUCHED")
        gone = [status == "OK" for status in statuses]
        if any(gone):
            self.count(tier, "evictions", sum(gone))
        return gone

    def evict_chains(
        self,
        victims: list[EvictionCandidate],
        tier: TierKind,
        wanted_bytes: int,
        pressed: list[TierKind],
        *,
        since_ms: int | None = None,
        touched: set[int] | None = None,
    ) -> list[int]:
        """Evict ``victims`` in order (a chain chunk that later chunks hang off goes after them: its
        chain is cut back from the leaves, wherever they are; evict_chains.lua) until
        ``wanted_bytes`` of ``tier`` went here (plain sizes, as the index has them, on the disk
        tier too); returns the alloc ids of ``tier`` here that went. At most CHAIN_VICTIMS (each
        walks its chain in the one script call; the caller sends more in further calls). Not those
        with a later chunk on one of this node's ``pressed`` tiers: those tiers' own passes move it,
        nor those whose chain was accessed after ``since_ms`` (the sample's time).
        Every object evicted is counted here, those on other nodes and tiers included: this pass
        evicted them, and their own nodes and passes never hear of it."""
        if not victims:
            return []
        _, evicted, statuses, gone = self.agent.index.evict_chains(
            [(v.key, v.alloc_id) for v in victims],
            node_id=self.agent.node_id,
            tier=str(tier),
            wanted_bytes=wanted_bytes,
            most_later=MOST_LATER_CHUNKS,
            pressed_tiers=[str(t) for t in pressed],
            since_ms=since_ms,
        )
        if touched is not None:
            touched.update(v.alloc_id for v, status in zip(victims, statuses, strict=True) if status == "TOUCHED")
        if evicted:
            self.count(tier, "evictions", evicted)
        return gone

    def demote_gpu(self, victim: EvictionCandidate, gpu_offset: int) -> bool:
        """Copy a GPU-tier object to a host block (one device-to-host copy) and swap it there;
        False when no host block fits it or the object changed meanwhile."""
        with self.gate.move():
            return self._demote_gpu(victim, gpu_offset)

    def _demote_gpu(self, victim: EvictionCandidate, gpu_offset: int) -> bool:
        agent = self.agent
        assert agent.gpu is not None
        allocs = agent.table.reserve([(victim.size_bytes, b"demote-gpu" + bytes(6))])
        if allocs is None:
            return False
        alloc = allocs[0]
        # The agent's own move target: committed at once, so no reservation timeout can free it
        # between the copy and the swap; it is freed below if the swap does not happen.
        agent.table.commit([alloc.alloc_id])
        try:
            with agent.arena.device_view(alloc.offset, victim.size_bytes) as view:
                agent.gpu.read_to_host(gpu_offset, view)
        except Exception:
            agent.table.free([alloc.alloc_id])
            raise
        return self._swap_into(
            victim.key,
            victim.alloc_id,
            TierKind.HOST,
            alloc.offset,
            alloc.alloc_id,
            victim.size_bytes,
            (TierKind.GPU, "demotions"),
        )

    # ---- promotion --------------------------------------------------------------------------
    def promote(self, disk_id: int, data: bytearray) -> bool:
        """Bring an object read from disk back to host memory, if that leaves the host tier under
        its high watermark (so promotion and demotion do not chase each other) and no writer
        waits for room there (PressureManager.writer_may_wait)."""
        with self.gate.move():
            return self._promote(disk_id, data)

    def _promote(self, disk_id: int, data: bytearray) -> bool:
        agent = self.agent
        key = agent.disk_keys.get(disk_id)
        if key is None or agent.pressure.writer_may_wait(TierKind.HOST):
            return False
        # The watermark is checked by the reservation itself: checked apart, readers of several
        # disk objects at once each found room and together took the host tier past it.
        ceiling = int(agent.config.high_watermark * agent.table.capacity_bytes)
        tag = b"promote-" + disk_id.to_bytes(8, "little")
        allocs = agent.table.reserve([(len(data), tag)], ceiling_bytes=ceiling)
        if allocs is None:
            return False
        alloc = allocs[0]
        agent.table.commit([alloc.alloc_id])  # see demote_gpu: no timeout may free a move's target
        view = agent.arena.view(alloc.offset, len(data))
        try:
            view[:] = data
        finally:
            view.release()
        return self._swap_into(
            key,
            disk_id,
            TierKind.HOST,
            alloc.offset,
            alloc.alloc_id,
            len(data),
            (TierKind.DISK, "promotions"),
            promotion=True,
        )

    def relocate(self, victim: EvictionCandidate, offset: int) -> bool:
        """Copy a host-tier object (at ``offset`` in the arena) to another block of the same arena
        and swap it there (agent/compaction.py: the block it leaves joins a window being emptied).
        The new block is wherever the allocator puts it; the caller holds the window's free pieces,
        so it is outside. False when there is no room, or the object moved, went or was pinned."""
        with self.gate.move():
            return self._relocate(victim, offset)

    def _relocate(self, victim: EvictionCandidate, offset: int) -> bool:
        table, arena = self.agent.table, self.agent.arena
        tag = b"compact-" + victim.alloc_id.to_bytes(8, "little")
        allocs = table.reserve([(victim.size_bytes, tag)])
        if allocs is None:
            return False
        target = allocs[0]
        table.commit([target.alloc_id])  # see demote_gpu: no timeout may free a move's target
        # As a TCP read does: the old block is not freed under the copy (a removal meanwhile).
        if not table.begin_read(victim.alloc_id, offset, victim.size_bytes):
            self._drop_target(target.alloc_id, TierKind.HOST)
            return False
        try:
            # Inside the try: a view of an arena closed meanwhile (the agent stopping) raises, and
            # the read's mark and the target are let go all the same.
            with arena.view(offset, victim.size_bytes) as source, arena.view(target.offset, victim.size_bytes) as dest:
                dest[:] = source
        except BaseException:
            self._drop_target(target.alloc_id, TierKind.HOST)
            raise
        finally:
            table.end_read(victim.alloc_id)
        return self._swap_into(
            victim.key,
            victim.alloc_id,
            TierKind.HOST,
            target.offset,
            target.alloc_id,
            victim.size_bytes,
            (TierKind.HOST, "compacted"),
        )
