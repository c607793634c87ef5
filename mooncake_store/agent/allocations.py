"""The agent's table of allocations in its host arena, with their life cycle::

    RESERVED --(commit acked)--> COMMITTED --(grave due)--> freed
       └──(revoked / abandoned after the reservation timeout)--> freed

A free of an allocation that a TCP read or write is still moving, or that a same-host writer holds
fenced, is deferred until that ends, so a slow reader or writer never sees its bytes reused under
it (DESIGN.md §3.3).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from mooncake_store.policy.compaction import Block, fits
from mooncake_store.tiers.allocator import ALIGNMENT, OffsetAllocator

#: An allocation's ``held_until`` while drop_after_reap holds it until hold_reaped says how long
#: (the purge's answer at the next registration): no time frees it before then.
UNTIL_REAP_ANSWERED = float("inf")


class AllocState(StrEnum):
    RESERVED = "RESERVED"
    COMMITTED = "COMMITTED"


@dataclass(slots=True)
class Allocation:
    alloc_id: int
    offset: int
    length: int
    put_id: bytes
    state: AllocState
    deadline: float  # monotonic seconds; meaningful while RESERVED
    readers: int = 0  # TCP reads and writes in progress, and fences: a free waits for them
    doomed: bool = False
    #: Monotonic s: a doomed allocation is not freed before then (read leases granted before a
    #: reap of the node still run; drop_after_reap).
    held_until: float = 0.0


class AllocationTable:
    def __init__(
        self,
        capacity_bytes: int,
        *,
        reserve_timeout_s: float,
        alignment: int = ALIGNMENT,
        ids: Iterator[int] | None = None,
    ) -> None:
        self._allocator = OffsetAllocator(capacity_bytes, alignment=alignment)
        self._allocs: dict[int, Allocation] = {}
        #: Allocations in state COMMITTED, kept as a running count: usage() runs on every RESERVE
        #: and for every victim of a pressure pass, and counting there cost O(objects) each time.
        self._committed = 0
        #: Allocations in state RESERVED: the sync scans their deadlines five times a second, and
        #: they are the puts in flight, not every object.
        self._reserved: dict[int, Allocation] = {}
        #: Doomed allocations held past their last reader until held_until (release_held frees them).
        self._held: dict[int, Allocation] = {}
        #: Holds that drop_after_reap replaced by UNTIL_REAP_ANSWERED: hold_reaped never
        #: ends one sooner than it was (a rollback's or an earlier loss's hold on the same block).
        self._held_before_reap: dict[int, float] = {}
        self._lock = threading.Lock()
        self._reserve_timeout_s = reserve_timeout_s
        # Start alloc ids from the clock so that a restarted agent never reissues an id that an old
        # index entry still names; ids stay below 2**53 for JSON round trips.
        # Tables of one agent (host, GPU) share one id iterator, so an id names one location.
        self._ids = ids if ids is not None else itertools.count(int(time.time() * 1000) << 10)

    @property
    def ids(self) -> Iterator[int]:
        return self._ids

    def __contains__(self, alloc_id: int) -> bool:
        with self._lock:
            return alloc_id in self._allocs

    def new_id(self) -> int:
        """A fresh alloc id, for locations outside this table (disk files) that share the id space."""
        with self._lock:
            return next(self._ids)

    def bytes_of(self, alloc_ids: list[int]) -> int:
        """Reserved bytes of those of ``alloc_ids`` that are live here."""
        with self._lock:
            return sum(self._allocs[a].length for a in alloc_ids if a in self._allocs)

    def offset_of(self, alloc_id: int) -> tuple[int, int] | None:
        """(offset, length) of a live allocation."""
        with self._lock:
            alloc = self._allocs.get(alloc_id)
            return (alloc.offset, alloc.length) if alloc else None

    # ---- queries --------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._allocator.capacity_bytes

    def usage(self) -> tuple[int, int, int, int]:
        """(used bytes, free bytes, largest free block, committed objects)."""
        with self._lock:
            return (
                self._allocator.used_bytes,
                self._allocator.free_bytes,
                self._allocator.largest_free_bytes,
                self._committed,
            )

    def room(self, *, ceiling_bytes: int | None = None) -> tuple[int, int]:
        """(free bytes, largest free block) that a reservation may still take: with
        ``ceiling_bytes`` (a peer's spill, as in reserve), no more than takes the use up to it."""
        with self._lock:
            free, largest = self._allocator.free_bytes, self._allocator.largest_free_bytes
            if ceiling_bytes is not None:
                free = min(free, max(0, ceiling_bytes - self._allocator.used_bytes))
                largest = min(largest, free)
            return free, largest

    def reserved_deadlines(self) -> dict[int, float]:
        with self._lock:
            return {a.alloc_id: a.deadline for a in self._reserved.values()}

    def live_reservations(self) -> dict[int, bytes]:
        """alloc id -> put id of the reservations not committed nor freed (a freed one may only be
        held for readers): the allocations a pending put or a spill's guard may still name."""
        with self._lock:
            return {a.alloc_id: a.put_id for a in self._reserved.values() if not a.doomed}

    def put_id_of(self, alloc_id: int) -> bytes | None:
        with self._lock:
            alloc = self._allocs.get(alloc_id)
            return alloc.put_id if alloc else None

    def largest_object(self) -> int:
        """What the largest allocation takes (0 for none): a walk over all of them."""
        with self._lock:
            return self._allocator.largest_allocation_bytes

    def free_blocks_of(self, size: int) -> int:
        """How many blocks of ``size`` bytes the free room holds side by side (a walk over it)."""
        with self._lock:
            return sum(free // size for _, free in self._allocator.free_blocks()) if size > 0 else 0

    def known_ids(self) -> set[int]:
        with self._lock:
            return set(self._allocs)

    def __len__(self) -> int:
        with self._lock:
            return len(self._allocs)

    def layout(self, movable: Callable[[Allocation], bool]) -> list[Block]:
        """The arena in address order, free blocks and allocations, for a compaction to choose its
        window by: an allocation is movable when committed, not doomed nor being moved by a read,
        write or fence, and ``movable`` says so (the index's view: no pin, no live lease)."""
        with self._lock:
            by_offset = {alloc.offset: alloc for alloc in self._allocs.values()}
            blocks = [Block(offset, size) for offset, size in self._allocator.free_blocks()]
            for offset, size in self._allocator.allocations():
                alloc = by_offset.get(offset)
                if alloc is None:  # a compaction's hold: no allocation of this table
                    blocks.append(Block(offset, size, alloc_id=-1))
                    continue
                ok = alloc.state == AllocState.COMMITTED and not alloc.doomed and alloc.readers == 0 and movable(alloc)
                blocks.append(Block(offset, size, alloc_id=alloc.alloc_id, movable=ok))
        blocks.sort(key=lambda block: block.offset)
        return blocks

    def hold_free_in(self, start: int, end: int) -> list[tuple[int, int]]:
        """Take the free pieces of ``[start, end)`` so that no reservation lands there while a
        compaction empties it; returns them (offset, size), their offsets for release_holds.
        Counted as used meanwhile."""
        with self._lock:
            pieces = []
            for offset, size in self._allocator.free_blocks():
                low, high = max(offset, start), min(offset + size, end)
                if low < high:
                    pieces.append((low, high - low))
            for offset, size in pieces:
                self._allocator.take(offset, size)
            return pieces

    def release_holds(self, offsets: list[int]) -> None:
        with self._lock:
            for offset in offsets:
                self._allocator.free(offset)

    # ---- transitions ----------------------------------------------------------------------
    def footprint(self, requests: Sequence[tuple[int, bytes]]) -> int:
        """What ``requests`` (size, put_id) take in this arena: whole units each, one at least. The
        room to make for them: their raw sizes asked 3000 B for 3000 one-byte objects that take
        192,000 B, and a pressure pass that found a free block of 3000 B made none."""
        return sum(self.blocks_of(requests))

    def blocks_of(self, requests: Sequence[tuple[int, bytes]]) -> list[int]:
        """The block each of ``requests`` takes (footprint): a batch needs a free piece for each,
        not one block for their sum."""
        return [self._allocator.footprint(size) for size, _ in requests]

    def fits(self, blocks: Sequence[int]) -> bool:
        """Whether blocks of these sizes (footprints) would all be granted now, placed as reserve()
        places them (largest first, best fit): a batch waiting for room needs a piece for each, and
        the largest free block held the batch's sum only after a compaction joined blocks for its
        members one by one (the pressure pass then evicted for it all the same)."""
        if len(blocks) <= 1:
            return self.room()[1] >= sum(blocks)
        with self._lock:
            free_sizes = sorted(size for _, size in self._allocator.free_blocks())
        return fits(free_sizes, blocks)

    def reserve(
        self, requests: list[tuple[int, bytes]], *, ceiling_bytes: int | None = None
    ) -> list[Allocation] | None:
        """All or nothing: an Allocation per (size, put_id), or None when they do not all fit, or
        would take the table's use past ``ceiling_bytes`` (a peer's spill: its high watermark)."""
        now = time.monotonic()
        with self._lock:
            # In the allocator's units, as its use counts them: raw sizes let a spill of many
            # odd-sized objects end past the mark, and the peer spilled them straight back.
            if ceiling_bytes is not None and self._allocator.used_bytes + self.footprint(requests) > ceiling_bytes:
                return None
            # Placed largest first, best fit (as fits() judges a batch, and a compaction checks
            # its moves): in the batch's order a small object took the hole a larger one needed,
            # and a batch that fitted was refused while the pass, judging it by fits(), made no room.
            offsets: dict[int, int] = {}
            for i in sorted(range(len(requests)), key=lambda i: -self._allocator.footprint(requests[i][0])):
                offset = self._allocator.allocate(requests[i][0])
                if offset is None:
                    for placed in offsets.values():
                        self._allocator.free(placed)
                    return None
                offsets[i] = offset
            done: list[Allocation] = []
            for i, (size, put_id) in enumerate(requests):
                alloc = Allocation(
                    alloc_id=next(self._ids),
                    offset=offsets[i],
                    length=size,
                    put_id=put_id,
                    state=AllocState.RESERVED,
                    deadline=now + self._reserve_timeout_s,
                )
                self._allocs[alloc.alloc_id] = alloc
                self._reserved[alloc.alloc_id] = alloc
                done.append(alloc)
            return done

    def commit(self, alloc_ids: list[int] | tuple[int, ...]) -> None:
        with self._lock:
            for alloc_id in alloc_ids:
                alloc = self._allocs.get(alloc_id)
                if alloc is not None and alloc.state != AllocState.COMMITTED:
                    alloc.state = AllocState.COMMITTED
                    self._committed += 1
                    del self._reserved[alloc_id]

    def free(self, alloc_ids: list[int] | tuple[int, ...]) -> int:
        """Release allocations (decided by a sync); returns how many were released or doomed."""
        count = 0
        now = time.monotonic()
        with self._lock:
            for alloc_id in alloc_ids:
                alloc = self._allocs.get(alloc_id)
                if alloc is None:
                    continue
                count += 1
                if alloc.readers > 0 or alloc.held_until > now:
                    alloc.doomed = True
                    if alloc.held_until > now:  # freed by release_held once its hold is over
                        self._held[alloc_id] = alloc
                else:
                    self._release(alloc)
        return count

    def expire_now(self, alloc_ids: list[int]) -> int:
        """A writer gave up on these reservations. They are not freed here: the commit may have
        reached the index even though its writer saw an error, so the next sync decides (a commit
        acked in the index keeps the space, anything else frees it)."""
        count = 0
        now = time.monotonic()
        with self._lock:
            # Each id once: a FREE frame naming one twice answered 2 for the one reservation.
            for alloc_id in dict.fromkeys(alloc_ids):
                alloc = self._allocs.get(alloc_id)
                if alloc is not None and alloc.state == AllocState.RESERVED:
                    alloc.deadline = min(alloc.deadline, now)
                    count += 1
        return count

    def drop_after_reap(self) -> None:
        """After the node was reaped, in one step: committed objects are gone from the index, but
        same-host readers may still copy them from the arena under read leases granted before the
        purge, which this table never sees: their memory is doomed and held until hold_reaped()
        says how long those leases run (the purge's answer; until then, for good). Reservations of
        puts in flight only expire, so the next sync revokes their pending records before freeing
        them; their memory is not freed before hold_reaped() either, since a reservation may be an
        object the lost index had committed (its ack not yet drained here) and readers leased."""
        now = time.monotonic()
        with self._lock:
            for alloc in list(self._allocs.values()):
                if alloc.state == AllocState.RESERVED:
                    alloc.deadline = min(alloc.deadline, now)
                    if not alloc.doomed:
                        self._hold_until_told(alloc)
                elif not alloc.doomed:
                    alloc.doomed = True
                    self._hold_until_told(alloc)
                    self._held[alloc.alloc_id] = alloc

    def _hold_until_told(self, alloc: Allocation) -> None:
        """Under the lock: held for good until hold_reaped, which keeps any hold it had before."""
        if alloc.held_until != UNTIL_REAP_ANSWERED:
            self._held_before_reap.setdefault(alloc.alloc_id, alloc.held_until)
        alloc.held_until = UNTIL_REAP_ANSWERED

    def hold_reservations(self, hold_ms: int) -> None:
        """Free no current reservation before ``hold_ms`` from now, whenever a sync frees it: after
        the index went back in time, one may be an object it had committed (and leased out) whose
        ack went back with it, so that the agent only expires it."""
        until = time.monotonic() + hold_ms / 1000
        with self._lock:
            for alloc in self._reserved.values():
                if not alloc.doomed:
                    alloc.held_until = max(alloc.held_until, until)

    def committed_ids(self) -> list[int]:
        with self._lock:
            return [a.alloc_id for a in self._allocs.values() if a.state == AllocState.COMMITTED and not a.doomed]

    def doom(self, alloc_ids: list[int], *, hold_ms: int) -> int:
        """Committed allocations no index names any more (it went back to before they were
        committed): doomed, held ``hold_ms`` for readers that may still copy them, then freed by
        release_held. Returns how many were doomed."""
        until = time.monotonic() + hold_ms / 1000
        doomed = 0
        with self._lock:
            for alloc_id in alloc_ids:
                alloc = self._allocs.get(alloc_id)
                if alloc is None or alloc.state != AllocState.COMMITTED or alloc.doomed:
                    continue
                alloc.doomed = True
                alloc.held_until = until
                self._held[alloc_id] = alloc
                doomed += 1
        return doomed

    def hold_reaped(self, held_ms: Mapping[int, int], *, at_least_ms: int = 0) -> None:
        """The reaped objects' memory (drop_after_reap) is held for as long as ``held_ms`` says per
        alloc id (the read leases on it), each at least ``at_least_ms``, and the rest freed now."""
        now = time.monotonic()
        with self._lock:
            for alloc_id in held_ms:
                alloc = self._allocs.get(alloc_id)
                if alloc is not None and alloc_id not in self._held:
                    # Committed in the index but not yet here (the sync that drains its ack had not
                    # run): a reservation, which its sync would free at once; readers have it too.
                    alloc.doomed = True
                    alloc.held_until = UNTIL_REAP_ANSWERED
                    self._held[alloc_id] = alloc
            for alloc in self._held.values():
                hold_ms = max(at_least_ms, held_ms.get(alloc.alloc_id, 0))
                self._hold_for(alloc, now + hold_ms / 1000)
            # The other reservations drop_after_reap kept: a purge names those it found committed
            # (above), so the rest were puts in flight, free once revoked (at_least_ms 0); an index
            # that lost the record named none, and any of them may have been read under a lease.
            for alloc in self._reserved.values():
                if alloc.alloc_id not in self._held and alloc.held_until == UNTIL_REAP_ANSWERED:
                    self._hold_for(alloc, now + at_least_ms / 1000)
            self._held_before_reap.clear()
        self.release_held()

    def _hold_for(self, alloc: Allocation, until: float) -> None:
        """Under the lock: hold ``alloc`` until ``until``, or longer where an earlier hold (a
        rollback's, an earlier loss's) runs longer: a reap's answer never cuts one short."""
        earlier = self._held_before_reap.get(alloc.alloc_id, 0.0)
        if alloc.held_until != UNTIL_REAP_ANSWERED:
            earlier = max(earlier, alloc.held_until)
        alloc.held_until = max(earlier, until)

    def held_bytes(self, within_s: float) -> tuple[int, int]:
        """(all, due within ``within_s``): bytes of doomed allocations held for readers the index
        no longer names (drop_after_reap, doom, a free during a hold). They free themselves, and
        no move can take them: a pressure pass that counted them as used moved or evicted the
        objects put since for them."""
        due = time.monotonic() + within_s
        with self._lock:
            held = list(self._held.values())
        return sum(a.length for a in held), sum(a.length for a in held if a.held_until <= due)

    def release_held(self) -> int:
        """Free the held allocations whose hold is over and that no TCP read moves; returns how many."""
        now = time.monotonic()
        freed = 0
        with self._lock:
            for alloc in [a for a in self._held.values() if a.held_until <= now and a.readers == 0]:
                self._release(alloc)
                freed += 1
        return freed

    def _release(self, alloc: Allocation) -> None:
        self._held.pop(alloc.alloc_id, None)
        del self._allocs[alloc.alloc_id]
        if alloc.state == AllocState.COMMITTED:
            self._committed -= 1
        else:
            del self._reserved[alloc.alloc_id]
        self._allocator.free(alloc.offset)

    def begin_write(self, alloc_id: int, offset: int, length: int) -> bool:
        """A write must land inside a live reservation (committed bytes are never rewritten); it
        also fences the allocation: a free while the bytes arrive only marks it
        doomed, so a slow writer never lands in a block that was handed to another object."""
        with self._lock:
            alloc = self._allocs.get(alloc_id)
            ok = (
                alloc is not None
                and alloc.state == AllocState.RESERVED
                and not alloc.doomed
                and alloc.offset <= offset
                and offset + length <= alloc.offset + alloc.length
            )
            if ok:
                assert alloc is not None
                alloc.readers += 1
            return ok

    def end_write(self, alloc_id: int) -> bool:
        """Ends a fenced write; False when the reservation was freed meanwhile (the write is void)."""
        with self._lock:
            alloc = self._allocs.get(alloc_id)
            if alloc is None:
                return False
            alloc.readers -= 1
            if alloc.readers == 0 and alloc.doomed and alloc.held_until <= time.monotonic():
                self._release(alloc)
                return False
            return not alloc.doomed

    def begin_read(self, alloc_id: int, offset: int, length: int) -> bool:
        """Register a reader of [offset, offset+length) if that range belongs to the allocation.

        A reservation may be read too: the index only hands out a location after its commit, and
        the agent may not have drained that commit's ack yet."""
        with self._lock:
            alloc = self._allocs.get(alloc_id)
            if alloc is None or alloc.doomed or offset < alloc.offset or offset + length > alloc.offset + alloc.length:
                return False
            alloc.readers += 1
            return True

    def end_read(self, alloc_id: int) -> None:
        with self._lock:
            alloc = self._allocs.get(alloc_id)
            if alloc is None:
                return
            alloc.readers -= 1
            if alloc.readers == 0 and alloc.doomed and alloc.held_until <= time.monotonic():
                self._release(alloc)
