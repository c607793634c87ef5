"""The agent's server hooks (AgentHooks, agent/ops.py) for the tiers other than the host arena:
reads, reservations, room and writes of GPU-tier objects and of chunk files peers spill onto the disk
tier, and promotion after a disk read. A mixin of Agent, kept apart so that node.py stays the
agent's wiring and life cycle; it uses only the attributes declared below, which Agent sets.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from mooncake_store.agent.allocations import AllocationTable
from mooncake_store.agent.read_budget import OtherTierCopy
from mooncake_store.errors import MooncakeError
from mooncake_store.tiers.chunk_format import ChunkUnreadable, CorruptChunk
from mooncake_store.transport.frames import TIER_DISK, TIER_GPU
from mooncake_store.types import TierKind

if TYPE_CHECKING:
    from mooncake_store.agent.inbox import DiskInbox
    from mooncake_store.agent.pressure import PressureManager
    from mooncake_store.config import AgentConfig
    from mooncake_store.index import RedisIndex
    from mooncake_store.tiers.disk import DiskTier
    from mooncake_store.tiers.gpu import GpuArena

log = logging.getLogger("mooncake.agent")


class OtherTierHooks:
    config: AgentConfig
    node_id: str
    index: RedisIndex
    disk_keys: dict[int, str]
    damaged_disk_ids: set[int]
    gpu: GpuArena | None
    table: AllocationTable
    gpu_table: AllocationTable | None
    disk: DiskTier | None
    inbox: DiskInbox | None
    pressure: PressureManager

    def other_tier_extent(self, alloc_id: int) -> tuple[int, int] | None:
        if self.gpu_table is not None and alloc_id in self.gpu_table:
            return self.gpu_table.offset_of(alloc_id)  # a GPU replica's offset is its place in the arena
        entry = self.disk.entry(alloc_id) if self.disk is not None else None
        return (0, entry.raw_bytes) if entry is not None else None

    def read_other_tier(self, alloc_id: int) -> OtherTierCopy | None:
        if self.gpu is not None and self.gpu_table is not None and alloc_id in self.gpu_table:
            got = self.read_gpu(alloc_id)
            return OtherTierCopy(*got, TierKind.GPU) if got is not None else None
        data = self.read_disk(alloc_id)  # ChunkUnreadable: to the READ, which tells its reader
        if data is None:
            return None  # STALE: the reader looks the object up again
        return OtherTierCopy(data, 0, TierKind.DISK)  # offsets into a disk allocation count from its start

    def other_tier_read(self, tier: TierKind) -> None:
        self.pressure.count(tier, "reads")

    def read_disk(self, alloc_id: int) -> bytearray | None:
        """A disk object's bytes, checked; None when there is no such file or it is damaged (then
        its replica is dropped). ChunkUnreadable for a file kept but not readable now (out of
        memory or descriptors, permissions changed), for a READ to tell its reader why (it was
        told the agent no longer held the object)."""
        disk = self.disk
        entry = disk.entry(alloc_id) if disk is not None else None
        if disk is None or entry is None:
            return None
        try:
            data = bytearray(entry.raw_bytes)
        except MemoryError:
            # No fault of the file's: it is kept, and this read fails (it escaped the connection's
            # handler, which answers MooncakeErrors only; the tier's own reads say so themselves).
            said = f"no memory to read disk allocation {alloc_id} ({entry.raw_bytes} B) now; the file is kept"
            log.warning("%s; the read fails", said)
            raise ChunkUnreadable(said) from None
        try:
            disk.read_into(alloc_id, memoryview(data))
        except CorruptChunk as exc:
            # A file freed while it was read (a spill victim holds no read lease) went with its
            # entry, which goes first (DiskTier.remove): that is no damage.
            if disk.entry(alloc_id) is not None:
                self._drop_corrupt(alloc_id, exc)
            return None
        except MooncakeError as exc:  # freed between the entry and the read, or not readable now
            if disk.entry(alloc_id) is not None:
                log.warning("disk allocation %d not read: %s", alloc_id, exc)
                if isinstance(exc, ChunkUnreadable):
                    raise
            return None
        return data

    def check_disk_replica(self, alloc_id: int) -> None:
        """Decode a chunk file here, after a peer refused it when it was spilled or copied: a
        spill sends the file as stored, unchecked (the peer decodes it whole), so a damaged one
        would be sent again at every pass. A damaged file's replica is dropped, as a read's is; one
        not readable now is kept (its next spill tries again)."""
        with contextlib.suppress(ChunkUnreadable):
            self.read_disk(alloc_id)

    def _drop_corrupt(self, alloc_id: int, exc: CorruptChunk) -> None:
        """A chunk file failed its checksum: its replica leaves the index, so that readers go to
        another replica or find no object (a miss) instead of failing on it again and again; the
        file goes through the graveyard. Counted as "corrupt" in the disk tier's counters, once:
        a spill's refusal and a read that both met it counted one file twice."""
        if alloc_id in self.damaged_disk_ids:
            return  # dropped already
        key = self.disk_keys.get(alloc_id)
        log.error("disk allocation %d (key %r) is damaged: %s; dropping that replica", alloc_id, key, exc)
        self.damaged_disk_ids.add(alloc_id)
        if key is None:
            # A peer's file whose swap landed in the index but not yet in this agent's sync (reads
            # of it are refused meanwhile): dropped once its ack names its key. Left at that, it
            # stayed listed, and every read failed on it for as long as the agent ran.
            return
        self._drop_from_index(alloc_id, key)

    def drop_settled_corrupt(self, alloc_id: int) -> None:
        """A peer's file just settled (its key named by the sync): one found damaged before, while
        its key was unknown, leaves the index now, as a read's would have dropped it. A damaged
        file whose key was known is dropped at once, so such an id here is one of those."""
        key = self.disk_keys.get(alloc_id)
        if alloc_id in self.damaged_disk_ids and key is not None:
            self._drop_from_index(alloc_id, key)

    def _drop_from_index(self, alloc_id: int, key: str) -> None:
        try:
            dropped = self.index.drop_corrupt(key, alloc_id, node_id=self.node_id)
        except MooncakeError as err:
            self.damaged_disk_ids.discard(alloc_id)  # still listed: the next read drops it
            log.warning("could not drop the damaged replica of %r from the index: %s", key, err)
            return
        if dropped:
            self.pressure.count(TierKind.DISK, "corrupt")

    def read_gpu(self, alloc_id: int) -> tuple[bytearray, int] | None:
        """A GPU-tier object copied to host memory (fenced against frees), with its arena offset."""
        assert self.gpu is not None and self.gpu_table is not None
        location = self.gpu_table.offset_of(alloc_id)
        if location is None:
            return None
        offset, length = location
        if not self.gpu_table.begin_read(alloc_id, offset, length):
            return None
        try:
            data = bytearray(length)
            self.gpu.read_to_host(offset, memoryview(data))
        finally:
            self.gpu_table.end_read(alloc_id)
        return data, offset  # a GPU replica's offset is its place in the arena

    def spill_ceiling(self, tier: int) -> int:
        if tier == TIER_DISK:
            capacity = self.disk.capacity_bytes if self.disk is not None else 0
        elif tier == TIER_GPU:
            capacity = self.gpu_table.capacity_bytes if self.gpu_table is not None else 0
        else:
            capacity = self.table.capacity_bytes
        return int(self.config.high_watermark * capacity)

    def reserve_other_tier(
        self, tier: int, requests: list[tuple[int, bytes]], *, spill: bool, make_room: bool, spared_peers: int = 0
    ) -> list[Any] | None:
        if tier == TIER_DISK:
            if self.inbox is None or not spill:
                return None  # a disk takes spills only, each up to its high watermark
            return self.inbox.reserve(requests, ceiling_bytes=self.spill_ceiling(tier))
        if self.gpu_table is None:
            return None
        allocs = self.gpu_table.reserve(requests, ceiling_bytes=self.spill_ceiling(tier) if spill else None)
        if allocs is None and make_room:  # not for a spill or a probe (ops.py): each goes elsewhere
            self.pressure.want_room(self.gpu_table.blocks_of(requests), tier=TierKind.GPU, spared_peers=spared_peers)
        return allocs

    def other_tier_room(self, tier: int, *, spill: bool) -> tuple[int, int, int]:
        if tier == TIER_DISK:
            if self.disk is None or self.inbox is None or not spill:
                return 0, 0, 0  # puts never go to disk
            free = self.inbox.room(ceiling_bytes=self.spill_ceiling(tier))
            return free, free, self.disk.capacity_bytes  # a file needs no contiguous block
        if self.gpu_table is None:
            return 0, 0, 0
        free, largest = self.gpu_table.room(ceiling_bytes=self.spill_ceiling(tier) if spill else None)
        return free, largest, self.gpu_table.capacity_bytes

    def longest_write(self) -> int:
        # A peer's chunk file may be longer than the host arena (the zstd bound of the largest
        # memory tier): one refused while others arrive is drained, its stream kept.
        largest_file = self.inbox.largest_file if self.inbox is not None else None
        gpu = self.gpu_table.capacity_bytes if self.gpu_table is not None else 0
        return max(self.arena.size_bytes, gpu, largest_file or 0)

    def fence_table(self, alloc_id: int) -> AllocationTable | None:
        return self.gpu_table if self.gpu_table is not None and alloc_id in self.gpu_table else None

    def other_tier_staging(self, alloc_id: int, offset: int, length: int) -> bytearray | None:
        if self.inbox is not None and alloc_id in self.inbox:
            return self.inbox.staging(alloc_id, offset, length)
        if self.gpu_table is None or not self.gpu_table.begin_write(alloc_id, offset, length):
            return None
        try:
            return bytearray(length)
        except MemoryError:  # the fence must not outlive a buffer that could not be made
            self.gpu_table.end_write(alloc_id)
            return None

    def other_tier_written(self, alloc_id: int, offset: int, data: bytearray | None) -> bool:
        if self.inbox is not None and alloc_id in self.inbox:
            return self.inbox.written(alloc_id, data)
        assert self.gpu is not None and self.gpu_table is not None
        try:
            if data is not None:
                self.gpu.write_from_host(offset, memoryview(data))
        finally:
            still_reserved = self.gpu_table.end_write(alloc_id)
        return data is not None and still_reserved

    def after_other_tier_read(self, alloc_id: int, data: bytearray) -> None:
        # Disk reads only (a GPU read comes here too); queued, not run on this connection's thread.
        if self.config.promote_on_read and alloc_id in self.disk_keys:
            self.pressure.promotions.offer(alloc_id, data)
