"""Which objects to relocate inside an arena so that one free block of a wanted size appears.

An arena whose free room is in pieces refuses a reservation larger than its largest piece however
many bytes are free. Nothing chose victims by address before: a peer asked for a repair or a spill
never makes room (it would push others' objects out for them), and a pressure pass moves the
coldest objects wherever they lie, so their freed blocks seldom join. A compaction moves the few
objects that sit inside the cheapest window of the wanted size into free blocks outside it, inside
the same arena (agent/compaction.py), and the window's pieces then join into one block.

Pure: tested on tables of blocks (tests/unit/test_compaction_window.py).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass

#: Windows checked for fit, cheapest first, before the choice gives up.
MAX_TRIES = 32


@dataclass(frozen=True, slots=True)
class Block:
    """A piece of an arena in address order: free (``alloc_id`` None), or an allocation, which
    may be moved (``movable``) or not (pinned, leased, being written or read, unknown)."""

    offset: int
    size: int  # what it takes in the arena: whole alignment units
    alloc_id: int | None = None
    movable: bool = False

    @property
    def free(self) -> bool:
        return self.alloc_id is None

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True, slots=True)
class Window:
    """``[start, start + size)`` to empty, and the allocations inside it (or across its end) to
    move out; ``moved_bytes`` is what that copies."""

    start: int
    size: int
    moves: tuple[Block, ...]

    @property
    def moved_bytes(self) -> int:
        return sum(block.size for block in self.moves)


def choose_window(blocks: Sequence[Block], size: int) -> Window | None:
    """The window of ``size`` bytes that takes the fewest bytes moved to empty (the lowest such
    offset among equals) whose allocations are all movable and fit, best fit and largest first,
    into the free blocks outside it; None when there is none. ``blocks``: the whole arena in address
    order, free blocks and allocations, each starting where the one before ends.

    A window starts at a block's start: one that starts inside a free block holds less of it, and
    one that starts inside an allocation moves it all the same."""
    if size <= 0:
        return None
    candidates: list[tuple[int, int, int, int]] = []  # (moved bytes, start, first block, last block)
    last = 0
    moved = 0  # bytes of the allocations in blocks[first:last]
    for first, head in enumerate(blocks):
        if last < first:
            last, moved = first, 0
        # Grow the span until it covers the window, or meets what cannot move (then no window
        # starts at or before that block within reach: the next start is past it).
        while last < len(blocks) and blocks[last].offset < head.offset + size and _may_empty(blocks[last]):
            moved += 0 if blocks[last].free else blocks[last].size
            last += 1
        covered = blocks[last - 1].end - head.offset if last > first else 0
        if covered >= size:
            candidates.append((moved, head.offset, first, last))
        if not _may_empty(head):
            last, moved = first + 1, 0
        elif last > first and not head.free:
            moved -= head.size
    # The cheapest few only: each fit check walks the arena's free blocks, and an arena of many
    # small objects has as many candidates, which together would take the pass minutes.
    free_sizes = sorted(block.size for block in blocks if block.free)
    for _moved, start, first, last in sorted(candidates)[:MAX_TRIES]:
        inside = blocks[first:last]
        moves = tuple(block for block in inside if not block.free)
        if _fits_outside(free_sizes, inside, start + size, moves):
            return Window(start=start, size=size, moves=moves)
    return None


def _may_empty(block: Block) -> bool:
    return block.free or block.movable


def _fits_outside(free_sizes: list[int], inside: Sequence[Block], end: int, moves: Sequence[Block]) -> bool:
    """Whether ``moves`` fit, as the allocator would place them (best fit, largest first: the
    compactor moves them in that order, agent/compaction.py), into the free room outside the window
    that ``inside`` (its blocks, from the window's start) covers up to ``end``: the window's own
    pieces are held while they move, and what a free block across its end has past it stays free.
    ``free_sizes``: the sizes of every free block, sorted."""
    sizes = list(free_sizes)
    for block in inside:
        if block.free:
            del sizes[bisect_left(sizes, block.size)]
            if block.end > end:
                insort(sizes, block.end - end)
    return fits(sizes, [move.size for move in moves])


def largest_first(blocks: Sequence[Block]) -> list[Block]:
    """The order in which a window's allocations are moved out, and their fit is checked in."""
    return sorted(blocks, key=lambda block: (-block.size, block.offset))


def fits(free_sizes: list[int], sizes: Sequence[int]) -> bool:
    """Whether blocks of ``sizes`` all fit at once into free blocks of ``free_sizes`` (sorted; taken
    up as they are used), placed as the allocator places them: best fit, largest first. A batch's
    reservations need not fit in one block, only each in a piece of its own."""
    for size in sorted(sizes, reverse=True):
        i = bisect_left(free_sizes, size)
        if i == len(free_sizes):
            return False
        rest = free_sizes.pop(i) - size
        if rest:
            insort(free_sizes, rest)
    return True
