"""Best-fit offset allocator for one arena (host DRAM segment, GPU buffer, disk file).

The allocator hands out offsets only; it never touches memory, so the same class serves every tier.
Free space is kept in three views that always describe the same set of free blocks:

* ``_free``: offset -> size, to find a block by its start;
* ``_by_size``: sorted ``(size, offset)``, so best fit is one ``bisect`` (smallest block that fits,
  lowest offset among equal sizes, which keeps allocations packed towards the start);
* ``_offsets``: sorted free offsets, so the neighbours of a freed block are one ``bisect`` away.

Lookups are O(log n); list insertion/removal is a ``memmove`` of the tail, which for the block counts
an arena sees (thousands, not millions) is far cheaper than a balanced tree in pure Python.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from mooncake_store.errors import InvalidValue


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; allocate(True) is a caller bug, not a 1-byte request.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidValue(f"{name} must be int, got {type(value).__name__}: {value!r:.80}")
    return value


class OffsetAllocator:
    """Best-fit offset allocator over [0, capacity) with alignment and coalescing. Not thread-safe (the
    agent holds a lock).

    Every offset handed out is a multiple of ``alignment`` and every reservation is a whole number of
    alignment units, so splitting a free block never produces a misaligned remainder. If ``capacity``
    is not a multiple of ``alignment`` the last partial unit still counts as free but can never be
    handed out (no request is smaller than one unit).
    """

    __slots__ = ("_alignment", "_by_size", "_capacity", "_free", "_free_total", "_live", "_offsets")

    def __init__(self, capacity_bytes: int, *, alignment: int = 64) -> None:
        capacity_bytes = _check_int("capacity_bytes", capacity_bytes)
        alignment = _check_int("alignment", alignment)
        if capacity_bytes <= 0:
            raise InvalidValue(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidValue(f"alignment must be a power of two, got {alignment}")
        self._capacity = capacity_bytes
        self._alignment = alignment
        self._free: dict[int, int] = {0: capacity_bytes}
        self._by_size: list[tuple[int, int]] = [(capacity_bytes, 0)]
        self._offsets: list[int] = [0]
        self._live: dict[int, int] = {}
        # Kept as a running total so used/free/fragmentation are O(1) for stats and heartbeats.
        self._free_total = capacity_bytes

    # -- free-block bookkeeping (all three views change together) --------------------------------

    def _add_free(self, offset: int, size: int) -> None:
        self._free[offset] = size
        insort(self._by_size, (size, offset))
        insort(self._offsets, offset)

    def _remove_free(self, offset: int) -> int:
        size = self._free.pop(offset)
        i = bisect_left(self._by_size, (size, offset))
        del self._by_size[i]
        j = bisect_left(self._offsets, offset)
        del self._offsets[j]
        return size

    # -- public API -----------------------------------------------------------------------------

    def allocate(self, size_bytes: int) -> int | None:
        """Reserve ``size_bytes`` (rounded up to the alignment; 0 takes one unit so that every live
        allocation has a distinct offset). Returns the offset, or ``None`` when no free block fits."""
        size_bytes = _check_int("size_bytes", size_bytes)
        if size_bytes < 0:
            raise InvalidValue(f"size_bytes must be >= 0, got {size_bytes}")
        unit = self._alignment
        need = max(unit, (size_bytes + unit - 1) // unit * unit)
        # (need, -1) sorts before every (need, offset>=0): the smallest fitting block, lowest offset.
        i = bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        block_size, offset = self._by_size[i]
        self._remove_free(offset)
        if block_size > need:
            self._add_free(offset + need, block_size - need)
        self._live[offset] = need
        self._free_total -= need
        return offset

    def free(self, offset: int) -> int:
        """Release the allocation at ``offset`` and return its reserved size. The block merges with a
        free neighbour on either side, so freeing everything leaves one block of full capacity."""
        offset = _check_int("offset", offset)
        size = self._live.pop(offset, None)
        if size is None:
            if self._containing_free_block(offset) is not None:
                raise InvalidValue(f"offset {offset} is already free (double free)")
            raise InvalidValue(f"offset {offset} is not the start of a live allocation")
        self._free_total += size
        start, end = offset, offset + size
        i = bisect_left(self._offsets, offset)
        # Left neighbour: the free block just below must end exactly where this one starts.
        if i > 0:
            left = self._offsets[i - 1]
            if left + self._free[left] == start:
                self._remove_free(left)
                start = left
        # Right neighbour: a free block starting exactly at our end.
        right_size = self._free.get(end)
        if right_size is not None:
            self._remove_free(end)
            end += right_size
        self._add_free(start, end - start)
        return size

    def size_of(self, offset: int) -> int:
        """Reserved (aligned) size of the live allocation at ``offset``."""
        offset = _check_int("offset", offset)
        size = self._live.get(offset)
        if size is None:
            raise InvalidValue(f"offset {offset} is not the start of a live allocation")
        return size

    def _containing_free_block(self, offset: int) -> int | None:
        i = bisect_left(self._offsets, offset + 1) - 1
        if i >= 0:
            start = self._offsets[i]
            if offset < start + self._free[start]:
                return start
        return None

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used_bytes(self) -> int:
        return self._capacity - self._free_total

    @property
    def free_bytes(self) -> int:
        return self._free_total

    @property
    def largest_free_bytes(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def num_allocations(self) -> int:
        return len(self._live)

    def fragmentation(self) -> float:
        """``1 - largest_free / free``: 0.0 when all free space is one block (or nothing is free),
        approaching 1.0 as free space splinters into many small blocks."""
        if self._free_total == 0:
            return 0.0
        return 1.0 - self.largest_free_bytes / self._free_total

    def free_blocks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free block in address order; for stats and tests."""
        return [(off, self._free[off]) for off in self._offsets]

    def allocations(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every live allocation in address order; for stats and tests."""
        return sorted(self._live.items())

    def __repr__(self) -> str:
        return (
            f"OffsetAllocator(capacity={self._capacity}, used={self.used_bytes}, "
            f"allocations={len(self._live)}, free_blocks={len(self._free)}, "
            f"largest_free={self.largest_free_bytes})"
        )
