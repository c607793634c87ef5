"""Chunk files that peers spill onto this agent's disk tier, while they are in flight.

A peer under disk pressure moves a cold chunk here as DESIGN.md §3.4 wants: it reserves room
(RESERVE on tier 2, sized by the chunk file, which travels compressed as it is stored), sends the
whole file in one WRITE, and swaps the location in the index. Until this agent's sync sees the
swap's ack, the reservation lives in a table of its own, with the host tier's rules: a timeout
frees it unless the swap reached the index, a free while the bytes arrive voids the write, and a
committed file is never rewritten. Once acked, the file is an ordinary disk-tier allocation and
the table forgets it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator

from mooncake_store.agent.allocations import Allocation, AllocationTable
from mooncake_store.errors import MooncakeError
from mooncake_store.tiers.disk import DiskTier

log = logging.getLogger("mooncake.agent")


class DiskInbox:
    def __init__(self, disk: DiskTier, *, reserve_timeout_s: float, ids: Iterator[int]) -> None:
        self.disk = disk
        # Offsets in this table mean nothing on disk; it keeps the reservations' life cycle and
        # their bytes, which count against the disk tier's free room until the files land.
        self.table = AllocationTable(1 << 62, reserve_timeout_s=reserve_timeout_s, alignment=1, ids=ids)
        self._lock = threading.Lock()
        #: Bytes of reservations whose files have not landed, by alloc id, and their sum: the room
        #: they are promised (free_bytes runs per victim of every pressure pass, and used to walk
        #: the whole table).
        self._on_wire: dict[int, int] = {}
        self._on_wire_bytes = 0

    def __contains__(self, alloc_id: int) -> bool:
        return alloc_id in self.table

    def reserve(
        self, requests: list[tuple[int, bytes]], *, ceiling_bytes: int | None = None
    ) -> list[Allocation] | None:
        """All or nothing, like the host tier; None when the files would not fit on the disk, or
        would take its use past ``ceiling_bytes`` (the disk's high watermark)."""
        with self._lock:  # two concurrent spills must not both count the same free room
            # A file takes whole blocks of the disk, which is what its room is counted in.
            needed = sum(self.disk.footprint(size) for size, _ in requests)
            if needed > self.disk.free_bytes - self._on_wire_bytes:
                return None
            if ceiling_bytes is not None and self.disk.used_bytes + self._on_wire_bytes + needed > ceiling_bytes:
                return None
            allocs = self.table.reserve(requests)
            for alloc in allocs or []:
                footprint = self.disk.footprint(alloc.length)
                self._on_wire[alloc.alloc_id] = footprint
                self._on_wire_bytes += footprint
            return allocs

    def room(self, *, ceiling_bytes: int) -> int:
        """What a spill may still take: the free room (free_bytes), no more than takes the disk's
        use, files on the wire included, up to ``ceiling_bytes`` (as in reserve)."""
        with self._lock:
            used = self.disk.used_bytes + self._on_wire_bytes
            return min(self.disk.free_bytes - self._on_wire_bytes, max(0, ceiling_bytes - used))

    def free_bytes(self) -> int:
        """The disk's free room less what reserved files still on the wire will take (files that
        landed count in the disk's use already)."""
        with self._lock:
            return self.disk.free_bytes - self._on_wire_bytes

    def _landed(self, alloc_ids: Iterable[int]) -> None:
        """These reservations' bytes are no longer promised: their files landed, or they went."""
        with self._lock:
            for alloc_id in alloc_ids:
                self._on_wire_bytes -= self._on_wire.pop(alloc_id, 0)

    def staging(self, alloc_id: int, offset: int, length: int) -> bytearray | None:
        """A buffer for the whole chunk file of a reservation (fenced until written()), or None:
        a chunk file comes in one WRITE, never in pieces."""
        if self.table.offset_of(alloc_id) != (offset, length):
            return None
        if not self.table.begin_write(alloc_id, offset, length):
            return None
        try:
            return bytearray(length)
        except MemoryError:  # the fence must not outlive a buffer that could not be made
            self.table.end_write(alloc_id)
            return None

    def written(self, alloc_id: int, data: bytearray | None) -> bool:
        """Store a received chunk file (None: the transfer broke off) and lift the fence; False
        when the file was damaged or the reservation was freed meanwhile."""
        stored = False
        try:
            if data is not None:
                try:
                    self.disk.write_blob(alloc_id, data)
                    stored = True
                    self._landed([alloc_id])  # the file counts in the disk's use from now on
                except MooncakeError as exc:
                    log.warning("chunk file spilled to disk allocation %d refused: %s", alloc_id, exc)
        finally:
            still_reserved = self.table.end_write(alloc_id)
        if stored and not still_reserved:
            self.disk.remove(alloc_id)  # freed while it arrived: nobody will name it
        return stored and still_reserved

    def settle(self, acked: Iterable[int]) -> list[int]:
        """Forget the reservations whose swaps were acked (their files stay, as disk allocations);
        returns their ids."""
        done = [alloc_id for alloc_id in acked if alloc_id in self.table]
        self.table.free(done)
        self._landed(done)
        return done

    def free(self, alloc_ids: Iterable[int]) -> None:
        """Free reservations that timed out or were abandoned, with any file already written."""
        ids = [alloc_id for alloc_id in alloc_ids if alloc_id in self.table]
        self.table.free(ids)
        self._landed(ids)
        for alloc_id in ids:
            self.disk.remove(alloc_id)
