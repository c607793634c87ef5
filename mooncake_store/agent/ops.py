"""The agent's wire ops, as served on one connection: the control ops (reserve, free, fence,
unfence) and the data ops (read, write, digest), each checked before a byte of its payload is read.
AgentServer (agent/server.py) accepts the connections and reads each request's header; AgentOps,
its base, answers the request."""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
from typing import Any, Protocol

import xxhash

from mooncake_store.agent.allocations import AllocationTable
from mooncake_store.agent.failure_log import FailureLog
from mooncake_store.agent.read_budget import READ_BUDGET_WAIT_S, OtherTierCopy, ReadBudget
from mooncake_store.errors import MooncakeError, ProtocolError
from mooncake_store.tiers.chunk_format import HEADER as DISK_HEADER
from mooncake_store.tiers.chunk_format import ChunkUnreadable
from mooncake_store.tiers.host import HostArena, segment_digest
from mooncake_store.transport import frames
from mooncake_store.transport.frames import (
    PROBE_FLAG,
    SPILL_FLAG,
    TIER_DISK,
    TIER_GPU,
    TIER_HOST,
    Op,
    Status,
)
from mooncake_store.types import TierKind

log = logging.getLogger("mooncake.agent")

#: Chunk for draining the payload of a refused WRITE.
DRAIN_BYTES = 1 << 20
#: The slowest a request's bytes may arrive (frames.MIN_RATE_BPS says why), named here for the server.
MIN_RATE_BPS = frames.MIN_RATE_BPS


class AgentHooks(Protocol):
    """What the server asks of the agent beyond the host arena."""

    def other_tier_extent(self, alloc_id: int) -> tuple[int, int] | None:
        """(offset of its first byte in READ's terms, size) of an object in another tier, found
        without reading it; None when no other tier holds that alloc id."""

    def read_other_tier(self, alloc_id: int) -> OtherTierCopy | None:
        """The whole object of an alloc id that lives in another tier (GPU, disk), or None. READs
        of it at once share the copy (ReadBudget.shared)."""

    def other_tier_read(self, tier: TierKind) -> None:
        """A read of an object in another tier is being served (counted with that tier's
        activity): one per object, the READ of its first byte."""

    def after_other_tier_read(self, alloc_id: int, data: bytearray) -> None:
        """Called once the reply is sent: queues the promotion (agent/promotions.py)."""

    def host_read(self) -> None:
        """A read of an object in the host arena is being served (counted with the host tier's
        activity): one per object, its first stripe's READ."""

    def reserve_other_tier(
        self, tier: int, requests: list[tuple[int, bytes]], *, spill: bool, make_room: bool, spared_peers: int = 0
    ) -> list[Any] | None:
        """Reservations in tier ``tier`` (1: GPU, 2: disk, for spills only); None when the agent has
        no room or no such tier. ``spared_peers``: as for no_room."""

    def other_tier_room(self, tier: int, *, spill: bool) -> tuple[int, int, int]:
        """(free bytes, largest free block, capacity) of tier ``tier`` here, for a refusal's reply
        (zeros when there is no such tier, or it takes no such reservation)."""

    def longest_write(self) -> int:
        """The longest WRITE a reservation here may take (host arena, GPU tier, a peer's chunk file):
        one no longer is drained and refused (STALE) with the connection kept; a longer one closes it."""

    def other_tier_staging(self, alloc_id: int, offset: int, length: int) -> bytearray | None:
        """A host buffer to receive a WRITE into an allocation of another tier (which is fenced
        against frees until other_tier_written), or None."""

    def other_tier_written(self, alloc_id: int, offset: int, data: bytearray | None) -> bool:
        """Move a received WRITE (None: it broke off) into the other tier and lift the fence;
        False when the reservation was freed meanwhile (the write is void)."""

    def reserved(self) -> None:
        """A reservation was granted (the agent checks its watermark: relief starts early)."""

    def reclaim_now(self) -> None:
        """Free what is already due (graveyard entries past their lease, abandoned reservations)."""

    def no_room(self, blocks: list[int], *, spared_peers: int = 0) -> None:
        """A reservation of ``blocks`` (its requests' footprints) did not fit even after
        reclaim_now. ``spared_peers``: the marks of the
        nodes its put keeps other replicas on (frames.spared_peers), so the room is not made by
        spills to them."""

    def fragmented(self, blocks: list[int]) -> None:
        """A host reservation was refused while the arena had the bytes free, in pieces that do not
        hold ``blocks`` (its requests' footprints): whoever asked (a writer, a peer's spill or
        repair, a probe), the agent may move objects inside the arena to join blocks for them."""

    def spill_reserved(self, alloc_ids: list[int], tier: int) -> None:
        """Reservations flagged as spills from a peer were granted in ``tier`` (counted as spills
        in once their swaps land)."""

    def spill_ceiling(self, tier: int) -> int:
        """The most bytes tier ``tier`` may hold once it grants a peer's spill: its high watermark.
        The peer plans by a node table a heartbeat old; a spill that took this tier past its mark
        would come straight back out (spills went back and forth between two agents)."""

    def expire_other_tiers(self, alloc_ids: list[int]) -> int:
        """A FREE's share outside the host arena: reservations in other tiers that expire now."""

    def fence_table(self, alloc_id: int) -> AllocationTable | None:
        """The table of another tier whose reservations FENCE covers (the GPU tier's, which a
        same-host writer fills through CUDA IPC) when it holds ``alloc_id``; else None."""


class AgentOps:
    """What a connection's requests are answered with; AgentServer sets the state it uses."""

    _arena: HostArena
    _table: AllocationTable
    _timeout_s: float
    _hooks: AgentHooks
    #: FENCEd alloc ids per connection (only its own thread touches its set).
    _fences: dict[socket.socket, set[int]]
    counters: dict[str, int]
    _counters_lock: threading.Lock
    _unknown_ops: FailureLog
    _read_budget: ReadBudget

    def _count(self, op: str, nbytes: int) -> None:
        """One served READ or WRITE (``op`` "read" or "write") of ``nbytes``: connection threads
        count at once, and ``+=`` on a shared dict is no atomic step."""
        with self._counters_lock:
            self.counters[op + "s"] += 1
            self.counters[op + "_bytes"] += nbytes

    def _bad_request(self, conn: socket.socket, op: int) -> None:
        """Before closing on a frame of another protocol version or an op this agent lacks: a
        BAD_REQUEST reply in this agent's version (a = that version), so that the peer's unpack
        names both versions, or a newer client sees the op refused, instead of "peer closed the
        connection". A stream without our magic at all gets no reply."""
        with contextlib.suppress(OSError):
            conn.sendall(frames.pack(op | frames.REPLY_BIT, Status.BAD_REQUEST, frames.VERSION))

    def _reply(self, conn: socket.socket, op: Op, status: Status, a: int = 0, b: int = 0, c: int = 0) -> None:
        conn.sendall(frames.pack(op | frames.REPLY_BIT, status, a, b, c))

    def _by(self, started: float, length: int) -> float:
        """The deadline of a request that began at ``started`` and moves ``length`` bytes of
        payload (MIN_RATE_BPS)."""
        return started + self._timeout_s + length / MIN_RATE_BPS

    def _recv(self, conn: socket.socket, length: int, started: float) -> bytearray:
        buf = bytearray(length)
        frames.recv_into_by(conn, memoryview(buf), self._by(started, length), self._timeout_s)
        return buf

    def _send(self, conn: socket.socket, started: float, header: bytes, payload: bytes | bytearray) -> None:
        """A reply with a payload, by the request's deadline (the reader must keep up too)."""
        frames.send_all_by(conn, header, memoryview(payload), self._by(started, len(payload)), self._timeout_s)

    def _dispatch(self, conn: socket.socket, started: float, op: int, arg: int, a: int, b: int, c: int) -> bool:
        """Serve one request (begun at ``started``); False closes the connection (its stream can no
        longer be trusted)."""
        if op == Op.READ:
            return self._read(conn, started, a, b, c)
        if op == Op.WRITE:
            return self._write(conn, started, a, b, c)
        if op == Op.RESERVE:
            return self._reserve(conn, started, arg, a, b)
        if op == Op.FREE:
            return self._free(conn, started, arg)
        if op == Op.FENCE:
            return self._fence(conn, started, arg)
        if op == Op.UNFENCE:
            return self._unfence(conn, started, arg)
        if op == Op.DIGEST:
            return self._digest(conn, a, b, c)
        if op == Op.PING:
            # b: whose agent this is (its arena's digest, as the node table names the arena), so
            # that the agent itself and `doctor` can tell an address answered by another agent.
            self._reply(conn, Op.PING, Status.OK, frames.VERSION, segment_digest(self._arena.name))
            return True
        self._unknown_ops.failed(ProtocolError(f"unknown op {op}; the connection was closed"))
        self._bad_request(conn, op)
        return False

    def _in_arena(self, offset: int, length: int) -> bool:
        return offset >= 0 and length >= 0 and offset + length <= self._arena.size_bytes

    def _read(self, conn: socket.socket, started: float, alloc_id: int, offset: int, length: int) -> bool:
        if not self._in_arena(offset, length) or not self._table.begin_read(alloc_id, offset, length):
            return self._read_other_tier(conn, started, alloc_id, offset, length)
        try:
            # Counted before the reply goes: a client that has its bytes sees the read in stat().
            # One per object: a read striped over several READs is counted at its first.
            location = self._table.offset_of(alloc_id)
            if location is not None and location[0] == offset:
                self._hooks.host_read()
            view = self._arena.view(offset, length)
            try:
                header = frames.pack(Op.READ | frames.REPLY_BIT, Status.OK, 0, 0, length)
                frames.send_all_by(conn, header, view, self._by(started, length), self._timeout_s)
            finally:
                view.release()
        finally:
            self._table.end_read(alloc_id)
        self._count("read", length)
        return True

    def _read_other_tier(self, conn: socket.socket, started: float, alloc_id: int, offset: int, length: int) -> bool:
        # The range is checked before the object is read: a chunk file is decoded whole (its
        # checksum covers every byte), and a 1-byte READ past the end of a 1 GiB one cost as much.
        extent = self._hooks.other_tier_extent(alloc_id)
        if extent is None or offset < extent[0] or length < 0 or offset - extent[0] + length > extent[1]:
            self._reply(conn, Op.READ, Status.STALE)
            return True
        # The whole object is decoded (or copied out) and held until the replies of the READs that
        # share it have gone: bounded across connections (agent/read_budget.py).
        waited_until = min(self._by(started, length), started + READ_BUDGET_WAIT_S)
        make = functools.partial(self._copy_other_tier, alloc_id)
        with contextlib.ExitStack() as stack:
            try:
                held = stack.enter_context(
                    self._read_budget.shared(alloc_id, extent[1], deadline=waited_until, make=make)
                )
            except ChunkUnreadable:  # kept, not readable now: the reader (each sharing the copy) is told so
                self._reply(conn, Op.READ, Status.STALE, frames.STALE_UNREADABLE)
                return True
            if held.busy:
                budget = self._read_budget
                log.warning(
                    "READ of allocation %d (%d B) refused: %d B of READs held (budget %d B)",
                    alloc_id,
                    extent[1],
                    budget.held_bytes,
                    budget.limit_bytes,
                )
                # a: why; b, c: what is held and the budget, for the reader's message (StaleLocation).
                self._reply(conn, Op.READ, Status.STALE, frames.STALE_READS_HELD, budget.held_bytes, budget.limit_bytes)
                return True
            copy = held.copy
            start = offset - copy.base if copy is not None else -1
            if copy is None or start < 0 or start + length > len(copy.data):
                self._reply(conn, Op.READ, Status.STALE)
                return True
            if offset == extent[0]:  # one count per object, at the READ of its first byte
                self._hooks.other_tier_read(copy.tier)
            view = memoryview(copy.data)[start : start + length]
            header = frames.pack(Op.READ | frames.REPLY_BIT, Status.OK, 0, 0, length)
            try:
                frames.send_all_by(conn, header, view, self._by(started, length), self._timeout_s)
            finally:
                view.release()
        self._count("read", length)
        self._hooks.after_other_tier_read(alloc_id, copy.data)
        return True

    def _copy_other_tier(self, alloc_id: int) -> OtherTierCopy | None:
        try:
            return self._hooks.read_other_tier(alloc_id)
        except ChunkUnreadable:
            raise  # to _read_other_tier, which says so
        except MooncakeError as exc:
            log.warning("read of allocation %d failed: %s", alloc_id, exc)
            return None

    def _write(self, conn: socket.socket, started: float, alloc_id: int, offset: int, length: int) -> bool:
        # Past its deadline a WRITE ends as one whose writer died: the fence is lifted, the
        # reservation stays until it is freed or expires, the connection closes.
        deadline = self._by(started, length)
        if self._in_arena(offset, length) and self._table.begin_write(alloc_id, offset, length):
            # Fenced: a free while the payload arrives waits, and voids the write (STALE).
            view = self._arena.view(offset, length)
            try:
                frames.recv_into_by(conn, view, deadline, self._timeout_s)
            finally:
                view.release()
                still_reserved = self._table.end_write(alloc_id)
            self._count("write", length)
            self._reply(conn, Op.WRITE, Status.OK if still_reserved else Status.STALE)
            return True
        staging = self._hooks.other_tier_staging(alloc_id, offset, length)
        if staging is not None:
            received = False
            try:
                frames.recv_into_by(conn, memoryview(staging), deadline, self._timeout_s)
                received = True
            finally:
                ok = self._hooks.other_tier_written(alloc_id, offset, staging if received else None)
            self._reply(conn, Op.WRITE, Status.OK if ok else Status.STALE)
            return True
        if length > self._hooks.longest_write():
            # Not worth draining: no such write can ever be valid. STALE as for any write that no
            # reservation covers, then the close (the payload, if sent, is not read).
            with contextlib.suppress(OSError):
                self._reply(conn, Op.WRITE, Status.STALE)
            return False
        remaining = length
        sink = memoryview(bytearray(min(DRAIN_BYTES, max(1, length))))
        while remaining:
            n = min(len(sink), remaining)
            frames.recv_into_by(conn, sink[:n], deadline, self._timeout_s)
            remaining -= n
        self._reply(conn, Op.WRITE, Status.STALE)
        return True

    def _digest(self, conn: socket.socket, alloc_id: int, offset: int, length: int) -> bool:
        """The checksum a TCP writer commits, taken here of the bytes as they landed: its source may
        have changed while it was sent, and a checksum taken there would then describe bytes that
        were never stored. The writer sends this right behind its WRITE, while the bytes are likely
        still in cache; it no longer hashes its source, so the put makes one pass over them either way. The
        range is fenced while it is hashed, as for a WRITE: a free meanwhile voids it (STALE)."""
        if not (self._in_arena(offset, length) and self._table.begin_write(alloc_id, offset, length)):
            self._reply(conn, Op.DIGEST, Status.STALE)
            return True
        try:
            view = self._arena.view(offset, length)
            try:
                checksum = xxhash.xxh3_64_intdigest(view)
            finally:
                view.release()
        finally:
            still_reserved = self._table.end_write(alloc_id)
        self._reply(conn, Op.DIGEST, *((Status.OK, checksum) if still_reserved else (Status.STALE,)))
        return True

    def _reserve(self, conn: socket.socket, started: float, count: int, tier: int, flags: int) -> bool:
        if not 0 < count <= frames.MAX_BATCH or tier not in (TIER_HOST, TIER_GPU, TIER_DISK):
            self._reply(conn, Op.RESERVE, Status.BAD_REQUEST)
            return False
        raw = self._recv(conn, frames.RESERVE_ENTRY.size * count, started)
        requests = [(size, bytes(put_id)) for size, put_id in frames.RESERVE_ENTRY.iter_unpack(raw)]
        if tier == TIER_DISK and any(size < DISK_HEADER.size for size, _ in requests):
            # No chunk file is shorter than its header: such entries could only fill the inbox with
            # reservations (8192 per frame) that nothing will ever write.
            self._reply(conn, Op.RESERVE, Status.BAD_REQUEST)
            return True
        if tier != TIER_HOST:
            allocs = self._hooks.reserve_other_tier(
                tier,
                requests,
                spill=bool(flags & SPILL_FLAG),
                make_room=not flags & (SPILL_FLAG | PROBE_FLAG),
                spared_peers=frames.spared_peers(flags),
            )
            if allocs is None:
                free, largest, capacity = self._hooks.other_tier_room(tier, spill=bool(flags & SPILL_FLAG))
                self._reply(conn, Op.RESERVE, Status.NO_CAPACITY, free, largest, capacity)
                return True
            if flags & SPILL_FLAG:
                self._hooks.spill_reserved([x.alloc_id for x in allocs], tier)
            payload = b"".join(frames.RESERVE_REPLY.pack(x.offset, x.alloc_id) for x in allocs)
            self._send(conn, started, frames.pack(Op.RESERVE | frames.REPLY_BIT, Status.OK), payload)
            return True
        ceiling = self._hooks.spill_ceiling(tier) if flags & SPILL_FLAG else None
        allocs = self._table.reserve(requests, ceiling_bytes=ceiling)
        if allocs is None:
            # Space whose leases ran out since the last sync is free for the asking: a writer that
            # replaces objects quickly should not wait for the next sync tick.
            self._hooks.reclaim_now()
            allocs = self._table.reserve(requests, ceiling_bytes=ceiling)
        if allocs is None:
            free, largest = self._table.room(ceiling_bytes=ceiling)
            # A refused spill goes to another peer, and a probing writer to another node: no room
            # is made for either. The agent hears of the room wanted before the writer hears the
            # refusal: told after, a pass the writer brought about at once (a writer beside the
            # agent, or its next RESERVE served first) found no room wanted under the high
            # watermark, and made none.
            blocks = self._table.blocks_of(requests)
            if not flags & (SPILL_FLAG | PROBE_FLAG):
                self._hooks.no_room(blocks, spared_peers=frames.spared_peers(flags))
            if free >= sum(blocks):  # the bytes are here, in pieces
                self._hooks.fragmented(blocks)
            self._reply(conn, Op.RESERVE, Status.NO_CAPACITY, free, largest, self._table.capacity_bytes)
            return True
        if flags & SPILL_FLAG:
            self._hooks.spill_reserved([x.alloc_id for x in allocs], tier)
        self._hooks.reserved()
        payload = b"".join(frames.RESERVE_REPLY.pack(x.offset, x.alloc_id) for x in allocs)
        self._send(conn, started, frames.pack(Op.RESERVE | frames.REPLY_BIT, Status.OK), payload)
        return True

    def _fenceable(self, alloc_id: int) -> AllocationTable | None:
        """The table FENCE finds ``alloc_id`` in: the host arena's, or the GPU tier's."""
        return self._table if alloc_id in self._table else self._hooks.fence_table(alloc_id)

    def end_fence(self, alloc_id: int) -> bool:
        """Lift one fence; whether its reservation was still live (also at a connection's close)."""
        table = self._fenceable(alloc_id)
        return table.end_write(alloc_id) if table is not None else False

    def _fence(self, conn: socket.socket, started: float, count: int) -> bool:
        """Fence reservations for a writer that copies into them itself: a same-host peer's spill
        or put into the shared arena, a same-host put into the GPU tier through CUDA IPC. The reply
        names this arena (its digest) and says per id whether it is fenced (a live reservation, not
        being freed). Fences last until UNFENCE on this connection, or its close."""
        ids = self._ids(conn, started, Op.FENCE, count)
        if ids is None:
            return False
        fenced = self._fences.setdefault(conn, set())
        ok = bytearray(len(ids))
        for i, alloc_id in enumerate(ids):
            table = self._fenceable(alloc_id)
            if table is None or alloc_id in fenced:
                continue
            location = table.offset_of(alloc_id)
            if location is not None and table.begin_write(alloc_id, *location):
                fenced.add(alloc_id)
                ok[i] = 1
        self._reply_flags(conn, started, Op.FENCE, ok, segment_digest(self._arena.name))
        return True

    def _unfence(self, conn: socket.socket, started: float, count: int) -> bool:
        """Lift fences this connection holds; per id whether the reservation is still live (False:
        freed meanwhile, so what was copied into it is void)."""
        ids = self._ids(conn, started, Op.UNFENCE, count)
        if ids is None:
            return False
        fenced = self._fences.get(conn, set())
        ok = bytearray(len(ids))
        for i, alloc_id in enumerate(ids):
            if alloc_id in fenced:
                fenced.discard(alloc_id)
                ok[i] = self.end_fence(alloc_id)
        self._reply_flags(conn, started, Op.UNFENCE, ok)
        return True

    def _reply_flags(self, conn: socket.socket, started: float, op: Op, flags: bytearray, a: int = 0) -> None:
        """OK with one byte per id of the request (b = their count) after the header."""
        self._send(conn, started, frames.pack(op | frames.REPLY_BIT, Status.OK, a, len(flags)), flags)

    def _ids(self, conn: socket.socket, started: float, op: Op, count: int) -> list[int] | None:
        """The alloc ids of a FREE, FENCE or UNFENCE frame; None (BAD_REQUEST sent) for a bad count."""
        if not 0 < count <= frames.MAX_BATCH:
            self._reply(conn, op, Status.BAD_REQUEST)
            return None
        return frames.unpack_ids(self._recv(conn, frames.U64.size * count, started))

    def _free(self, conn: socket.socket, started: float, count: int) -> bool:
        ids = self._ids(conn, started, Op.FREE, count)
        if ids is None:
            return False
        freed = self._table.expire_now(ids) + self._hooks.expire_other_tiers(ids)
        self._reply(conn, Op.FREE, Status.OK, freed)
        return True
