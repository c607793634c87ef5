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
from mooncake_store.tiers.chunk_format import file_bytes_at_most
from mooncake_store.tiers.disk import DiskTier

log = logging.getLogger("mooncake.agent")

#: Bytes of chunk files arriving from peers held in memory at once (the largest file a peer may send
#: is always taken, one at a time): a file is checked whole before it is stored.
STAGING_BYTES = 256 << 20


class DiskInbox:
    def __init__(self, disk: DiskTier, *, reserve_timeout_s: float, ids: Iterator[int]) -> None:
        self.disk = disk
        # Offsets in this table mean nothing on disk; it keeps the reservations' life cycle and
        # their bytes, which count against the disk tier's free room until the files land.
        # The room the files will take is promised in the disk tier itself (DiskTier.promise), so
        # that nothing else stored there meanwhile (a demotion) can take it.
        self.table = AllocationTable(1 << 62, reserve_timeout_s=reserve_timeout_s, alignment=1, ids=ids)
        # No file larger than this can be taken (write_blob refuses it), and a WRITE into a
        # reservation holds its whole file in memory while it arrives: a reservation of any size
        # the disk had room for let a peer's 100-byte frames make the agent zero-fill buffers of up
        # to 90% of --disk-mem. Received files in memory at once are bounded too (one always).
        limit = disk.max_blob_raw_bytes
        self.largest_file = file_bytes_at_most(limit) if limit is not None else None
        self._staging_limit = max(STAGING_BYTES, self.largest_file or 0)
        self._staged: dict[int, int] = {}  # alloc id -> bytes of its file in memory, arriving
        self._alone: set[int] = set()  # of those, admitted with nothing else arriving: always taken
        self._staging_lock = threading.Lock()

    def __contains__(self, alloc_id: int) -> bool:
        return alloc_id in self.table

    def reserve(
        self, requests: list[tuple[int, bytes]], *, ceiling_bytes: int | None = None
    ) -> list[Allocation] | None:
        """All or nothing, like the host tier; None when the files would not fit on the disk, or
        would take its use past ``ceiling_bytes`` (the disk's high watermark)."""
        if self.largest_file is not None and any(size > self.largest_file for size, _ in requests):
            return None
        allocs = self.table.reserve(requests)
        if allocs is None:
            return None
        # A file takes whole blocks of the disk, which is what its room is counted in.
        footprints = {alloc.alloc_id: self.disk.footprint(alloc.length) for alloc in allocs}
        if not self.disk.promise(footprints, ceiling_bytes=ceiling_bytes):
            self.table.free(list(footprints))  # never handed out: nothing reads or writes them
            return None
        return allocs

    def room(self, *, ceiling_bytes: int) -> int:
        """What a spill may still take (as in reserve)."""
        return self.disk.room(ceiling_bytes=ceiling_bytes)

    def staging(self, alloc_id: int, offset: int, length: int) -> bytearray | None:
        """A buffer for the whole chunk file of a reservation (fenced until written()), or None:
        a chunk file comes in one WRITE, never in pieces."""
        if self.table.offset_of(alloc_id) != (offset, length):
            return None
        with self._staging_lock:
            arriving = sum(self._staged.values())
            if alloc_id in self._staged or (arriving and arriving + length > self._staging_limit):
                log.info("chunk file for disk allocation %d refused: %d B of files arriving", alloc_id, arriving)
                return None  # the sender places it again
            self._staged[alloc_id] = length
            if not arriving:
                self._alone.add(alloc_id)
        if not self.table.begin_write(alloc_id, offset, length):
            self._unstage(alloc_id)
            return None
        try:
            return bytearray(length)
        except MemoryError:  # the fence must not outlive a buffer that could not be made
            self.table.end_write(alloc_id)
            self._unstage(alloc_id)
            return None

    def _stage_check(self, alloc_id: int, data: bytearray) -> bool:
        """Count the plain bytes a received file is checked against (decoded whole) with it; False
        when that takes the files in memory past the bound. A few bytes of zstd frame may declare
        the largest size taken, and a check at a time on each connection multiplied it."""
        try:
            raw = self.disk.parse_header(data, where=f"chunk file for disk allocation {alloc_id}")[2]
        except MooncakeError:
            return True  # write_blob refuses it, and says why
        with self._staging_lock:
            others = sum(n for a, n in self._staged.items() if a != alloc_id)
            mine = self._staged.get(alloc_id, 0) + raw
            # One admitted alone is taken whatever arrived since (it was promised; its bytes are here).
            if others and others + mine > self._staging_limit and alloc_id not in self._alone:
                log.info("chunk file for disk allocation %d refused: %d B of files in memory", alloc_id, others)
                return False
            self._staged[alloc_id] = mine
        return True

    def _unstage(self, alloc_id: int) -> None:
        with self._staging_lock:
            self._staged.pop(alloc_id, None)
            self._alone.discard(alloc_id)

    def written(self, alloc_id: int, data: bytearray | None) -> bool:
        """Store a received chunk file (None: the transfer broke off) and lift the fence; False
        when the file was damaged or the reservation was freed meanwhile."""
        stored = False
        try:
            if data is not None and self._stage_check(alloc_id, data):
                try:
                    self.disk.write_blob(alloc_id, data)  # takes the room promised to it
                    stored = True
                except MooncakeError as exc:
                    log.warning("chunk file spilled to disk allocation %d refused: %s", alloc_id, exc)
        finally:
            still_reserved = self.table.end_write(alloc_id)
            self._unstage(alloc_id)
        if stored and not still_reserved:
            self.disk.remove(alloc_id)  # freed while it arrived: nobody will name it
        return stored and still_reserved

    def settle(self, acked: Iterable[int]) -> list[int]:
        """Forget the reservations whose swaps were acked (their files stay, as disk allocations);
        returns their ids."""
        done = [alloc_id for alloc_id in acked if alloc_id in self.table]
        self.table.free(done)
        self.disk.drop_promises(done)  # a file acked but never stored (a failed write) has one left
        return done

    def free(self, alloc_ids: Iterable[int]) -> None:
        """Free reservations that timed out or were abandoned, with any file already written."""
        ids = [alloc_id for alloc_id in alloc_ids if alloc_id in self.table]
        self.table.free(ids)
        self.disk.drop_promises(ids)
        for alloc_id in ids:
            self.disk.remove(alloc_id)
