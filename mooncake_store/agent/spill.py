"""Spilling to a peer in batches: what one pressure pass sends a peer moves in a few round trips.

A victim moved on its own costs a RESERVE round trip to the peer, a WRITE and its ack, and a
compare-and-swap in the index: three waits per object, the pressure thread idle in each. Here the
victims of a pass that go to one peer move batch by batch (at most ``BATCH_BYTES``), each batch as
DESIGN.md §3.4 wants a single move:

1. copy: one guard record in the index and one RESERVE frame for the whole batch (flag
   ``SPILL_FLAG``; all or nothing; every entry under the batch's put id, which names the guard),
   sent while the batch before it is still being written, then the WRITEs, which ``STREAMS``
   connections to the peer pull as each has room for one (``WRITE_WINDOW`` in flight on each, so
   that acks overlap bytes; host-tier objects in pieces of up to ``PIECE_BYTES``); the streams
   stay up for the whole spill and roll from one batch's pieces into the next's without waiting
   for the acks in between (agent/spill_writes.py);
2. compare-and-swap: one call of ``move_replicas.lua`` for the batch, a status per object, with
   ``move_replica.lua``'s rules (an object that is gone, replaced, moved or pinned meanwhile keeps
   its old location; none moves once the peer's sync has revoked the guard, which it does when any
   of the batch's reservations times out there);
3. free: the old copies are in this agent's graveyard (the swap put them there); every reservation
   whose write or swap did not succeed is expired on the peer in one FREE frame, but for a peer
   that timed out: hung, it would answer after another timeout; it reclaims them at its own.

A peer that refuses a reservation, or whose connection breaks, gets nothing more in this spill: the
batch under way (none of it swapped, not even what the peer acked before it broke) and the batches
not sent are handed back, to be placed elsewhere (pressure.py decides where: another of the peer's
tiers may still take them, but not one that broke, agent/placing.py PassState). So is a peer that
refuses every WRITE of a batch it reserved room for (a disk that fails its writes: tiers/disk.py);
jobs of a batch it refused only in part are handed back alone, and its later batches still go.

A peer on this host (same host id, shm among its transports) gets a host batch by memcpy into its
shared arena under its fence instead of WRITEs (agent/spill_shm.py).

The disk tier spills the same way into the peer's disk tier (RESERVE on tier 2): what travels is
the chunk file as stored, compressed and checksummed, which the peer verifies before it answers
the WRITE (agent/inbox.py), so the bytes are neither recompressed nor trusted blindly. The GPU
tier spills into the peer's GPU tier (tier 1): one device-to-host copy here, the peer's
host-to-device copy there. A repair with no peer that has the source's tier copies into another
tier (``source``): the object goes in the form that tier keeps (agent/payloads.py).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from mooncake_store.agent import spill_jobs as limits
from mooncake_store.agent.failure_log import FailureLog
from mooncake_store.agent.moves import MoveTarget
from mooncake_store.agent.payloads import Payload, with_payloads
from mooncake_store.agent.spill_jobs import (
    PIECE_BYTES,
    PeerTrouble,
    Reserved,
    SpillJob,
    SpillResult,
    Swapped,
    batches_of,
    fitting,
)
from mooncake_store.agent.spill_shm import ArenaCopies
from mooncake_store.agent.spill_writes import BatchWrites, RollingWrites
from mooncake_store.errors import AgentBusy, ConnectError, MooncakeError, NoCapacity, TransferError
from mooncake_store.transport.frames import SPILL_FLAG, TIER_DISK, TIER_GPU, TIER_HOST
from mooncake_store.transport.tcp import Reservation, TcpTransport
from mooncake_store.types import NodeInfo, Replica, ReplicaState, TierKind

__all__ = ["PIECE_BYTES", "SpillJob", "SpillResult", "Spiller"]

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent

log = logging.getLogger("mooncake.agent")

#: Connections per peer that carry a batch's writes at the same time.
STREAMS = 2
#: RESERVE's tier field per tier.
WIRE_TIER = {TierKind.HOST: TIER_HOST, TierKind.GPU: TIER_GPU, TierKind.DISK: TIER_DISK}


def sent_from_arena(source: TierKind, target: TierKind) -> bool:
    """Whether a job's bytes go to the peer straight from this agent's host arena: a host-tier
    object bound for a peer's host or GPU tier, whose wire form is the plain bytes (DESIGN.md §3.5:
    at most one copy per hop). Into a peer's disk tier it goes as a chunk file, made ahead
    (agent/payloads.py)."""
    return source == TierKind.HOST and target != TierKind.DISK


class Spiller:
    def __init__(self, agent: Agent, *, streams: int = STREAMS, batch_bytes: int = limits.BATCH_BYTES) -> None:
        self.agent = agent
        self._streams = max(1, streams)
        self._batch_bytes = batch_bytes
        timeout_s = min(limits.TIMEOUT_S, max(limits.MIN_TIMEOUT_S, 2 * agent.config.heartbeat_ttl_s))
        self.transport = TcpTransport(timeout_s=timeout_s, connections_per_peer=self._streams, stripe_bytes=1 << 62)
        # The WRITE streams (agent/spill_writes.py), which stay up for a whole spill.
        self._writers = ThreadPoolExecutor(max_workers=self._streams, thread_name_prefix="mc-spill-write")
        self._swapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mc-spill-swap")
        self._reserver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mc-spill-reserve")
        #: Bytes of the GPU or disk batch being sent, by alloc id (copied out of the device, or the
        #: chunk files read, just before the batch goes); host batches are sent from the arena.
        self._payloads: dict[int, Payload] = {}
        self._trouble = PeerTrouble()
        #: Host batches to same-host peers, by memcpy into their arenas.
        self.shm = ArenaCopies(agent, self.transport, self._trouble, streams=self._streams)
        #: Those peers' arenas, mapped here (the pressure loop maps them ahead and unmaps the gone).
        self.arenas = self.shm.arenas
        #: Per peer, its refusals in a row: told at INFO when they begin, then once a minute with
        #: the count. A repair asked a peer it could not fill every second, and said so each time.
        self._refusals: dict[str, FailureLog] = {}

    def take_unreachable(self) -> set[str]:
        return self._trouble.take()  # node ids of peers that failed on the connection since the last call

    def close(self) -> None:
        self.transport.close()
        self.shm.close()
        self._writers.shutdown(wait=False, cancel_futures=True)
        self._swapper.shutdown(wait=False, cancel_futures=True)
        self._reserver.shutdown(wait=False, cancel_futures=True)

    def spill(
        self,
        peer_node: NodeInfo,
        jobs: list[SpillJob],
        *,
        tier: TierKind = TierKind.HOST,
        copy: bool = False,
        source: TierKind | None = None,
    ) -> SpillResult:
        """Move ``jobs`` to ``peer_node``'s ``tier`` (the tier they are in here, unless ``source``
        says otherwise), batch by batch. While a batch's bytes go out, the next batch is reserved
        (reservation thread), its WRITEs queued behind the batch's own (the streams roll from one
        into the next: agent/spill_writes.py), and the batch before is swapped in the index (swap
        thread); all swaps are done when this returns. ``copy``: the objects stay here too, and
        the index adds the peer's copies as replicas (re-replication, copy_replicas.lua);
        ``moved`` then lists the jobs copied."""
        result = SpillResult()
        source = tier if source is None else source
        if tier == source == TierKind.HOST:
            # Map a same-host peer's arena before reserving there: populating a large mapping takes
            # ~0.1 s per GiB, which reservations already granted would spend ageing.
            self.arenas.segment(peer_node, tier)
        batches = collections.deque(batches_of(jobs, self._batch_bytes))
        swaps: list[Future[Swapped]] = []
        writes: RollingWrites | None = None
        # Batches whose bytes are going out, oldest first: the next is queued on the streams while
        # the one before is still being written, so they roll from one into the other.
        under_way: collections.deque[tuple[Reserved, BatchWrites]] = collections.deque()
        ahead: tuple[Future[Reserved | None], list[SpillJob]] | None = None
        # A batch taken off the reservations or the streams and not settled yet: should anything
        # raise meanwhile (a bug, or the agent closing the spiller: no more work can be
        # scheduled), its room on the peer goes back now, not when it times out there.
        in_hand: Reserved | None = None
        failure: BaseException | None = None
        try:
            while True:
                if ahead is None and len(under_way) < 2:
                    # The next batch's room is asked for while the batch before it is written, not
                    # earlier: a reservation lives reserve_timeout_s on the peer from the moment
                    # it is made, and must outlast that batch's bytes and its own.
                    ahead = self._reserve_next(peer_node, batches, tier, source)
                if ahead is None and not under_way:
                    break
                if ahead is not None and len(under_way) < 2:
                    future, planned = ahead
                    in_hand, ahead = future.result(), None
                    if in_hand is None:  # refused, or unreachable: nothing was reserved
                        result.refused = True
                        result.unsent.extend(planned + self._rest(batches))
                        continue
                    if in_hand.left:
                        # The peer took part of it (at its mark now): nothing more goes to it.
                        result.refused = True
                        result.unsent.extend(in_hand.left + self._rest(batches))
                        if in_hand.in_pieces:
                            result.in_pieces.update(job.victim.alloc_id for job in in_hand.left)
                    if not under_way:  # nothing else is being written: ask now, as this one goes
                        ahead = self._reserve_next(peer_node, batches, tier, source)
                    if not in_hand.batch:
                        in_hand = None
                        continue  # nothing in it could be read: it stays where it is
                    # A same-host peer's shared arena is its host tier: another of its tiers is written to.
                    segment = self.arenas.segment(peer_node, tier) if tier == source == TierKind.HOST else None
                    # Once a spill's WRITEs roll, its later batches join them: copied inline, a
                    # batch would hold back the settling of those queued before it.
                    if segment is None or writes is not None:  # WRITEs, queued behind the batch before
                        if writes is None:
                            writes = self._rolling(peer_node)
                        under_way.append((in_hand, writes.add(in_hand, self._views(in_hand, tier, source), tier)))
                        in_hand = None
                        continue
                    written, broken = self.shm.copy_batch(segment, peer_node, in_hand)  # copied here and now
                else:
                    in_hand, sent = under_way.popleft()
                    assert writes is not None
                    written, broken = writes.wait(sent)
                    self._written(peer_node, in_hand, written, broken, tier, source)
                stop = self._settle(peer_node, in_hand, written, broken, result, swaps, tier, copy, source)
                in_hand = None
                if stop:
                    # Nothing more goes to this peer in this pass: the batches under way are
                    # called back, those not reserved stay here.
                    if writes is not None:
                        self._call_back(peer_node, writes, under_way, result)
                    result.unsent.extend(self._rest(batches))
                    if ahead is not None:
                        self._give_back(peer_node, ahead[0])
                        result.unsent.extend(ahead[1])
                        ahead = None
        finally:
            if writes is not None:
                writes.close()
            if in_hand is not None:
                self._abandon(peer_node, in_hand)
            for reserved, _ in under_way:  # left by an exception: their room there goes back now
                self._abandon(peer_node, reserved)
            if ahead is not None:
                self._give_back(peer_node, ahead[0])
            failure = self._collect(swaps, result)
        if failure is not None:  # raised only when nothing else is on its way out
            raise failure
        return result

    def _reserve_next(
        self, peer_node: NodeInfo, batches: collections.deque[list[SpillJob]], tier: TierKind, source: TierKind
    ) -> tuple[Future[Reserved | None], list[SpillJob]] | None:
        """The next batch's reservation, asked for on the reservation thread, with the batch."""
        if not batches:
            return None
        batch = batches.popleft()
        return self._reserver.submit(self._reserve, peer_node, batch, tier, source), batch

    @staticmethod
    def _rest(batches: collections.deque[list[SpillJob]]) -> list[SpillJob]:
        """The jobs of the batches not reserved yet, which will not be: they stay here."""
        rest = [job for batch in batches for job in batch]
        batches.clear()
        return rest

    def _settle(
        self,
        peer_node: NodeInfo,
        reserved: Reserved,
        written: list[bool],
        broken: bool,
        result: SpillResult,
        swaps: list[Future[Swapped]],
        tier: TierKind,
        copy: bool,
        source: TierKind,
    ) -> bool:
        """A batch's writes are over: swap what landed (on the swap thread) or give the batch up.
        Returns True when nothing more goes to the peer in this pass."""
        if broken:
            self._trouble.unreachable(peer_node.node_id)
            # Nothing of a batch whose peer broke mid-way is swapped, not even what it acked: a
            # peer that died would take those objects' only copies with it once its heartbeat
            # lapsed. The whole batch stays here, to be placed again. Its room there goes back by
            # a FREE, but for a hung peer's (PeerTrouble).
            self._abandon(peer_node, reserved)
            result.refused = True
            result.unsent.extend(reserved.batch)
            return True
        swaps.append(
            self._swapper.submit(
                self._swap, peer_node, reserved.batch, reserved.reservations, written, tier, copy, source
            )
        )
        # Jobs whose WRITE the peer refused though it had reserved room for them (its disk
        # full or failing, its inbox full for a moment, a file it found damaged, a
        # reservation gone) are not swapped (their room there is expired) and stay here,
        # handed back to be placed again. Counted neither moved nor unsent, they were sent
        # to the same failing peer at every pass, and the node never got under its mark.
        # A peer that refused a whole batch is asked nothing more in this spill (a failing
        # disk also stops offering room: tiers/disk.py); one that refused some of it, a
        # moment's refusal, keeps its later batches (all of them were evicted for one).
        refused = [job for job, ok in zip(reserved.batch, written, strict=True) if not ok]
        if refused:
            log.info(
                "spill to %s: %d of %d object(s) refused at their writes; placing them again",
                peer_node.node_id, len(refused), len(reserved.batch),
            )  # fmt: skip
            result.unsent.extend(refused)
            result.write_refused.update(job.victim.alloc_id for job in refused)
        if len(refused) == len(reserved.batch):
            result.refused = True
            return True
        return False

    def _call_back(
        self,
        peer_node: NodeInfo,
        writes: RollingWrites,
        under_way: collections.deque[tuple[Reserved, BatchWrites]],
        result: SpillResult,
    ) -> None:
        """Stop the batches under way (all at once: none goes on while another is waited for),
        give their room on the peer back once their WRITEs out are answered, and hand their jobs
        back unsent. A batch leaves ``under_way`` only once let go (else the caller's cleanup)."""
        for _, sent in under_way:
            writes.cancel(sent)
        while under_way:
            later, sent = under_way[0]
            writes.wait(sent)
            under_way.popleft()
            self._abandon(peer_node, later)
            result.unsent.extend(later.batch)

    def _abandon(self, peer_node: NodeInfo, reserved: Reserved) -> None:
        """A reserved batch that will not be swapped: its bytes read ahead are dropped and its room
        on the peer goes back now, not when it times out there (but for a hung peer's)."""
        self._drop_payloads(reserved.batch)
        if reserved.reservations and not self._trouble.hung(peer_node.tcp_endpoint):
            self._expire(peer_node.tcp_endpoint, [r.alloc_id for r in reserved.reservations])

    @staticmethod
    def _collect(swaps: list[Future[Swapped]], result: SpillResult) -> BaseException | None:
        """Every swap's outcome into ``result``, and the first that raised (the agent closing its
        pools cancels the swaps not yet run): a swap that failed leaves the others' moves counted."""
        failure: BaseException | None = None
        for fut in swaps:
            try:
                swapped = fut.result()
            except BaseException as exc:
                failure = failure or exc
                continue
            result.moved.extend(swapped.moved)
            result.unknown.extend(swapped.unknown)
            result.error = result.error or swapped.error
        return failure

    def _give_back(self, peer_node: NodeInfo, ahead: Future[Reserved | None]) -> None:
        """A batch reserved ahead that will not be sent (the pass ended early): its room goes back
        now; from a hung peer (PeerTrouble) it is neither waited for nor freed."""
        # Read now, not in settle() as _abandon would: the pass takes its marks when spill()
        # returns, before a hung peer's answer comes, and a FREE then would wait out its timeout.
        hung = self._trouble.hung(peer_node.tcp_endpoint)

        def settle(done: Future[Reserved | None]) -> None:
            try:
                extra = done.result()
            except BaseException:  # failed or cancelled: nothing was reserved that we know of
                return
            if extra is not None:
                self._drop_payloads(extra.batch)
                if extra.reservations and not hung:
                    self._expire(peer_node.tcp_endpoint, [r.alloc_id for r in extra.reservations])

        if hung:
            ahead.add_done_callback(settle)  # its payloads are dropped once it is answered
        else:
            settle(ahead)

    def _reserve(self, peer_node: NodeInfo, batch: list[SpillJob], tier: TierKind, source: TierKind) -> Reserved | None:
        """Read what a batch not sent from the host arena sends, then reserve room for the batch on
        the peer; None when the peer refused (nothing was reserved)."""
        if not sent_from_arena(source, tier):
            batch = with_payloads(self.agent, batch, source, tier, self._payloads)
            if not batch:
                return Reserved(batch=[], reservations=[])
        peer = self.transport.peer(peer_node.tcp_endpoint)
        # One put id, and so one guard, for the whole batch: its reservations are made together
        # and time out together, and one that timed out refuses the batch's swap (move_replicas.lua
        # looks a shared guard up once). A guard per object cost a uuid, a SET and a DEL each.
        put_id = uuid.uuid4().bytes
        try:
            # The guard first: should the copy outlive the peer's reservation timeout, the peer's
            # sync deletes the guard and the swap is refused rather than naming freed memory.
            self.agent.index.guard_reservations([put_id.hex()], node_id=peer_node.node_id, ttl_ms=limits.GUARD_TTL_MS)
        except MooncakeError as exc:  # the index's failure, not the peer's
            log.info("spill of %d object(s) to %s: no guard: %s", len(batch), peer_node.node_id, exc)
            self._drop_payloads(batch)
            return None
        left: list[SpillJob] = []
        in_pieces = False

        def reserve() -> list[Reservation]:
            requests = [(job.wire_bytes, put_id) for job in batch]
            return peer.reserve(requests, node_id=peer_node.node_id, flags=SPILL_FLAG, tier=WIRE_TIER[tier])

        try:
            try:
                reservations = reserve()
            except NoCapacity as exc:
                # The peer filled since the node table was read, and takes spills only up to its
                # high watermark: what it says it can still take goes now, and only the rest is
                # placed again (elsewhere, else evicted) rather than the whole batch.
                count = fitting(batch, exc.free_bytes or 0, peer_node.tier(tier))
                if count == len(batch) and exc.largest_bytes is not None:
                    # It has the bytes, in pieces none of which holds the batch: what surely fits
                    # is what its largest free block holds. Refused whole, a repair to a peer 44%
                    # full with its room in 1 MiB holes copied not one of three 8 MiB objects, at
                    # every try, and they stayed one copy short for good.
                    count = fitting(batch, exc.largest_bytes, peer_node.tier(tier))
                    # Only a host arena compacts (agent/compaction.py): a GPU tier's pieces stay.
                    in_pieces = count < len(batch) and tier == TierKind.HOST
                if not 0 < count < len(batch):
                    raise
                batch, left = batch[:count], batch[count:]
                reservations = reserve()
        except MooncakeError as exc:
            refusals = self._refusals.setdefault(
                peer_node.node_id, FailureLog(log, f"spill to {peer_node.node_id}", every_s=60.0, level=logging.INFO)
            )
            refusals.failed(f"{len(batch) + len(left)} object(s) refused: {exc}")
            self._drop_payloads(batch + left)
            with contextlib.suppress(MooncakeError):  # no swap can use it now; else it waits out its TTL
                self.agent.index.drop_guards([put_id.hex()])
            # No answer, a reset or a timeout (not a refusal, nor an agent at its connection
            # limit, which answered): the caller leaves the peer out for a while.
            if isinstance(exc, TransferError) or (isinstance(exc, ConnectError) and not isinstance(exc, AgentBusy)):
                self._trouble.unreachable(peer_node.node_id)
            if in_pieces and isinstance(exc, NoCapacity) and not left:
                # It has the bytes, in pieces none of which holds the batch's first object: the
                # refusal asked it for such blocks, and the caller may wait for them.
                return Reserved(batch=[], reservations=[], left=batch, in_pieces=True)
            return None
        self._drop_payloads(left)
        if (refusals := self._refusals.get(peer_node.node_id)) is not None:
            refusals.succeeded()  # "works again, after N failures", once
        return Reserved(
            batch=batch,
            reservations=[Reservation(offset=r.offset, alloc_id=r.alloc_id, put_id=put_id) for r in reservations],
            left=left,
            in_pieces=in_pieces,
        )

    def _rolling(self, peer_node: NodeInfo) -> RollingWrites:
        """The streams that carry a spill's WRITEs to ``peer_node`` (agent/spill_writes.py)."""
        endpoint = peer_node.tcp_endpoint
        return RollingWrites(
            self.transport.peer(endpoint),
            streams=self._streams,
            pool=self._writers,
            on_failure=lambda exc: self._trouble.note(endpoint, exc),
        )

    def _views(self, reserved: Reserved, tier: TierKind, source: TierKind) -> list[memoryview]:
        """Each job's bytes of a reserved batch: in the host arena here, else read just before the
        batch went (payloads.py: with_payloads)."""
        if sent_from_arena(source, tier):
            return [self.agent.arena.view(job.offset, job.wire_bytes) for job in reserved.batch]
        return [memoryview(self._payloads[job.victim.alloc_id]) for job in reserved.batch]

    def _written(
        self,
        peer_node: NodeInfo,
        reserved: Reserved,
        written: list[bool],
        broken: bool,
        tier: TierKind,
        source: TierKind,
    ) -> None:
        """After a batch's WRITEs: its bytes read ahead go, a broken peer's connections are
        dropped, and a disk file the peer refused is checked here (the peer may have found it
        damaged)."""
        self._drop_payloads(reserved.batch)
        if broken:
            self.transport.drop_peer(peer_node.tcp_endpoint)
        elif tier == source == TierKind.DISK:
            for job, ok in zip(reserved.batch, written, strict=True):
                if not ok:
                    self.agent.check_disk_replica(job.victim.alloc_id)

    def _drop_payloads(self, batch: list[SpillJob]) -> None:
        for job in batch:
            self._payloads.pop(job.victim.alloc_id, None)

    def _swap(
        self,
        peer_node: NodeInfo,
        batch: list[SpillJob],
        reservations: list[Reservation],
        written: list[bool],
        tier: TierKind,
        copy: bool,
        source: TierKind,
    ) -> Swapped:
        """One compare-and-swap of the written jobs; every reservation not swapped is expired on the
        peer. Returns the jobs that moved (a job written but not swapped is dropped: its object
        changed meanwhile), or, when the swap call failed, the written jobs with their targets."""
        moves = [
            (
                job.victim.key,
                job.victim.alloc_id,
                Replica(
                    node_id=peer_node.node_id,
                    tier=tier,
                    # A disk allocation is read whole, from its file: offsets count from its start;
                    # host and GPU offsets are places in the peer's arena.
                    offset=0 if tier == TierKind.DISK else res.offset,
                    size_bytes=job.victim.size_bytes,
                    alloc_id=res.alloc_id,
                    state=ReplicaState.COMPLETE,
                ),
                res.put_id.hex(),
            )
            for job, res, ok in zip(batch, reservations, written, strict=True)
            if ok
        ]
        index, me = self.agent.index, self.agent.node_id
        try:
            if not moves:
                statuses = []
            elif copy:
                statuses = index.copy_replicas(moves, src_node=me)
            else:
                statuses = index.move_replicas(moves, old_node=me)
        except Exception as failure:
            # Whether the swap happened is unknown: expiring is still safe, since the peer keeps a
            # reservation whose swap reached the index (its ack list says so) and frees the rest.
            # A bug (not a MooncakeError) is handled alike and logged: raised, it ended the pass's
            # collection of the swaps after it, whose moves then went uncounted.
            exc = failure if isinstance(failure, MooncakeError) else MooncakeError(f"spill swap failed: {failure!r}")
            if exc is not failure:
                log.exception("swap of %d spilled object(s) to %s failed", len(moves), peer_node.node_id)
            self._expire(peer_node.tcp_endpoint, [r.alloc_id for r in reservations])
            # Nothing here to free either way for a copy, but one that landed is counted once the
            # index says so, as a move is (the next repair pass finds the object's count restored).
            counted = (source, "copies_out" if copy else "spills_out")
            unknown = [
                (job, MoveTarget(job.victim.key, peer_node.node_id, res.alloc_id, tier, counted))
                for job, res, ok in zip(batch, reservations, written, strict=True)
                if ok
            ]
            return Swapped(unknown=unknown, error=exc)
        swapped = iter(statuses)
        moved: list[SpillJob] = []
        leftover: list[int] = []
        for job, res, ok in zip(batch, reservations, written, strict=True):
            if ok and next(swapped) == "OK":
                moved.append(job)
            else:
                leftover.append(res.alloc_id)
        if leftover:
            self._expire(peer_node.tcp_endpoint, leftover)
        return Swapped(moved=moved)

    def _expire(self, endpoint: str, alloc_ids: list[int]) -> None:
        try:
            self.transport.peer(endpoint).free(alloc_ids)
        except MooncakeError:
            pass  # the peer reclaims the reservations after its timeout anyway
