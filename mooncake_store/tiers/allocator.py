"""Best-fit offset allocator for one arena (host DRAM segment, GPU buffer, disk file).

The allocator hands out offsets only; it never touches memory, so the same class serves every tier.
Free space is kept in views that always describe the same set of free blocks:

* ``_free``: start -> size, and ``_free_end``: end -> start, so a freed block's neighbours are one
  dict lookup away on either side;
* ``_sizes``: the sorted distinct sizes of free blocks, so best fit is one ``bisect`` (the smallest
  size that fits), and ``_at_size``: size -> a heap of the starts of free blocks of that size (the
  lowest offset among equal sizes, which keeps allocations packed towards the start), which also
  removes a block that merges away.

An operation is O(log n), plus a ``memmove`` of the distinct sizes when a size appears or goes.
Sorted lists of every block cost a ``memmove`` of the whole list per operation instead: ~70 us at
100,000 free blocks and ~350 us at 400,000 (an arena of many small objects freed out of order);
benchmarks/allocator.py measures both the mean and the slowest operation.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from mooncake_store.errors import InvalidValue
from mooncake_store.types import ALIGNMENT, footprint_bytes

__all__ = ["ALIGNMENT", "OffsetAllocator"]


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; allocate(True) is a caller bug, not a 1-byte request.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidValue(f"{name} must be int, got {type(value).__name__}: {value!r:.80}")
    return value


class _OffsetHeap:
    """A min-heap of distinct offsets that also removes any one of them in O(log n): each offset's
    place in the list is kept in ``_pos``, so a block that merges away leaves no entry behind."""

    __slots__ = ("_items", "_pos")

    def __init__(self) -> None:
        self._items: list[int] = []
        self._pos: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def lowest(self) -> int:
        return self._items[0]

    def push(self, offset: int) -> None:
        self._items.append(offset)
        self._sift_up(len(self._items) - 1, offset)

    def remove(self, offset: int) -> None:
        i = self._pos.pop(offset)
        last = self._items.pop()
        if i < len(self._items):  # the last entry fills the hole, then moves up or down
            self._sift_up(i, last)
            if self._items[i] == last:
                self._sift_down(i, last)

    def _sift_up(self, i: int, offset: int) -> None:
        items, pos = self._items, self._pos
        while i > 0:
            parent = (i - 1) >> 1
            above = items[parent]
            if above <= offset:
                break
            items[i] = above
            pos[above] = i
            i = parent
        items[i] = offset
        pos[offset] = i

    def _sift_down(self, i: int, offset: int) -> None:
        items, pos = self._items, self._pos
        n = len(items)
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            if child + 1 < n and items[child + 1] < items[child]:
                child += 1
            below = items[child]
            if offset <= below:
                break
            items[i] = below
            pos[below] = i
            i = child
        items[i] = offset
        pos[offset] = i


class OffsetAllocator:
    """Best-fit offset allocator over [0, capacity) with alignment and coalescing. Not thread-safe (the
    agent holds a lock).

    Every offset handed out is a multiple of ``alignment`` and every reservation is a whole number of
    alignment units, so splitting a free block never produces a misaligned remainder. If ``capacity``
    is not a multiple of ``alignment`` the last partial unit still counts as free but can never be
    handed out (no request is smaller than one unit).
    """

    __slots__ = ("_alignment", "_at_size", "_capacity", "_free", "_free_end", "_free_total", "_live", "_sizes")

    def __init__(self, capacity_bytes: int, *, alignment: int = ALIGNMENT) -> None:
        capacity_bytes = _check_int("capacity_bytes", capacity_bytes)
        alignment = _check_int("alignment", alignment)
        if capacity_bytes <= 0:
            raise InvalidValue(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidValue(f"alignment must be a power of two, got {alignment}")
        self._capacity = capacity_bytes
        self._alignment = alignment
        self._free: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._sizes: list[int] = []
        self._at_size: dict[int, _OffsetHeap] = {}
        self._live: dict[int, int] = {}
        # Kept as a running total so used/free/fragmentation are O(1) for stats and heartbeats.
        self._free_total = capacity_bytes
        self._add_free(0, capacity_bytes)

    # -- free-block bookkeeping (all views change together) ---------------------------------------

    def _add_free(self, offset: int, size: int) -> None:
        self._free[offset] = size
        self._free_end[offset + size] = offset
        heap = self._at_size.get(size)
        if heap is None:
            heap = self._at_size[size] = _OffsetHeap()
            insort(self._sizes, size)
        heap.push(offset)

    def _remove_free(self, offset: int) -> int:
        size = self._free.pop(offset)
        del self._free_end[offset + size]
        heap = self._at_size[size]
        heap.remove(offset)
        if not heap:
            del self._at_size[size]
            del self._sizes[bisect_left(self._sizes, size)]
        return size

    # -- public API -----------------------------------------------------------------------------

    def footprint(self, size_bytes: int) -> int:
        """What an allocation of ``size_bytes`` takes: whole alignment units, one at least."""
        return footprint_bytes(size_bytes, self._alignment)

    def allocate(self, size_bytes: int) -> int | None:
        """Reserve ``size_bytes`` (rounded up to the alignment; 0 takes one unit so that every live
        allocation has a distinct offset). Returns the offset, or ``None`` when no free block fits."""
        size_bytes = _check_int("size_bytes", size_bytes)
        if size_bytes < 0:
            raise InvalidValue(f"size_bytes must be >= 0, got {size_bytes}")
        need = self.footprint(size_bytes)
        i = bisect_left(self._sizes, need)  # the smallest size that fits; its lowest offset
        if i == len(self._sizes):
            return None
        block_size = self._sizes[i]
        offset = self._at_size[block_size].lowest()
        self._remove_free(offset)
        if block_size > need:
            self._add_free(offset + need, block_size - need)
        self._live[offset] = need
        self._free_total -= need
        return offset

    def take(self, offset: int, size_bytes: int) -> None:
        """Reserve exactly ``[offset, offset + size_bytes)``, which must lie inside one free block
        and be aligned (agent/compaction.py holds the free pieces of the window it empties, so
        that no reservation lands there meanwhile); freed as any allocation is."""
        offset, size_bytes = _check_int("offset", offset), _check_int("size_bytes", size_bytes)
        if size_bytes <= 0 or offset % self._alignment or size_bytes % self._alignment:
            raise InvalidValue(f"take({offset}, {size_bytes}): not whole units of {self._alignment} B")
        start = self._containing_free_block(offset)
        if start is None or offset + size_bytes > start + self._free[start]:
            raise InvalidValue(f"take({offset}, {size_bytes}): not inside one free block")
        block = self._remove_free(start)
        if offset > start:
            self._add_free(start, offset - start)
        if start + block > offset + size_bytes:
            self._add_free(offset + size_bytes, start + block - offset - size_bytes)
        self._live[offset] = size_bytes
        self._free_total -= size_bytes

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
        # Left neighbour: a free block ending exactly where this one starts.
        left = self._free_end.get(start)
        if left is not None:
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
        # A walk over the free blocks: only a refused free() asks, to say what it was, and take(),
        # which a compaction calls a few times per window.
        return next((start for start, size in self._free.items() if start <= offset < start + size), None)

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
        """The largest allocation that would fit now: whole units. The partial last unit of a
        capacity that is no multiple of the alignment is free but never handed out, and counted
        here it told a put (and the pressure loop's "room appeared") of room that was not there."""
        largest = self._sizes[-1] if self._sizes else 0
        return largest - largest % self._alignment

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
        return sorted(self._free.items())

    @property
    def largest_allocation_bytes(self) -> int:
        """The largest live allocation (0 when there is none); a walk over every one of them."""
        return max(self._live.values(), default=0)

    def allocations(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every live allocation in address order; for stats and tests."""
        return sorted(self._live.items())

    def __repr__(self) -> str:
        return (
            f"OffsetAllocator(capacity={self._capacity}, used={self.used_bytes}, "
            f"allocations={len(self._live)}, free_blocks={len(self._free)}, "
            f"largest_free={self.largest_free_bytes})"
        )
