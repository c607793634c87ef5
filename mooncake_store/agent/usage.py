"""What an agent publishes of its tiers at each heartbeat (capacity, use, objects, counters)."""

from __future__ import annotations

from collections.abc import Mapping

from mooncake_store.agent.allocations import AllocationTable
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.types import TierKind, TierUsage


def tier_usages(
    table: AllocationTable,
    gpu_table: AllocationTable | None,
    disk: DiskTier | None,
    counters: Mapping[TierKind, Mapping[str, int]],
) -> tuple[TierUsage, ...]:
    """The tiers fastest first: the GPU tier's and the disk tier's where the agent has them."""
    used, _, largest, objects = table.usage()
    host = TierUsage(
        tier=TierKind.HOST,
        capacity_bytes=table.capacity_bytes,
        used_bytes=used,
        objects=objects,
        counters=dict(counters[TierKind.HOST]),
        # Peers plan spills and writers rank nodes by it: bytes free in pieces hold no larger object.
        largest_free_bytes=largest,
    )
    tiers = [host]
    if gpu_table is not None:
        gpu_used, _, gpu_largest, gpu_objects = gpu_table.usage()
        tiers.insert(
            0,
            TierUsage(
                tier=TierKind.GPU,
                capacity_bytes=gpu_table.capacity_bytes,
                used_bytes=gpu_used,
                objects=gpu_objects,
                counters=dict(counters[TierKind.GPU]),
                largest_free_bytes=gpu_largest,
            ),
        )
    if disk is None:
        return tuple(tiers)
    disk = TierUsage(
        tier=TierKind.DISK,
        capacity_bytes=disk.capacity_bytes,
        used_bytes=disk.used_bytes,
        objects=disk.objects,
        block_bytes=disk.block_bytes,  # peers plan their spills here in these blocks
        counters={
            **counters[TierKind.DISK],
            "raw_bytes": disk.raw_bytes,
            "stored_bytes": disk.stored_bytes,  # the ratio's denominator (used counts blocks)
        },
    )
    return (*tiers, disk)
