"""OffsetAllocator: alignment, best fit, coalescing, error cases, and a randomized invariant check."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from mooncake_store.errors import InvalidValue
from mooncake_store.tiers.allocator import OffsetAllocator


def check_invariants(alloc: OffsetAllocator) -> None:
    """Live and free blocks tile [0, capacity) exactly: no overlap, no gap, no two adjacent free."""
    blocks = [(off, size, "live") for off, size in alloc.allocations()]
    blocks += [(off, size, "free") for off, size in alloc.free_blocks()]
    blocks.sort()
    cursor = 0
    prev_kind = ""
    for off, size, kind in blocks:
        assert off == cursor, f"gap or overlap at {cursor}: next block starts at {off}"
        assert size > 0
        if kind == "live":
            assert off % alloc.alignment == 0
            assert size % alloc.alignment == 0
        else:
            assert prev_kind != "free", f"adjacent free blocks not coalesced at {off}"
        cursor = off + size
        prev_kind = kind
    assert cursor == alloc.capacity_bytes
    used = sum(size for _, size in alloc.allocations())
    free = sum(size for _, size in alloc.free_blocks())
    assert used == alloc.used_bytes
    assert free == alloc.free_bytes
    assert alloc.used_bytes + alloc.free_bytes == alloc.capacity_bytes
    assert alloc.num_allocations == len(alloc.allocations())
    largest = max((size for _, size in alloc.free_blocks()), default=0)
    assert alloc.largest_free_bytes == largest - largest % alloc.alignment  # whole units: what fits


def test_constructor_rejects_bad_values() -> None:
    with pytest.raises(InvalidValue, match="0"):
        OffsetAllocator(0)
    with pytest.raises(InvalidValue, match="-5"):
        OffsetAllocator(-5)
    with pytest.raises(InvalidValue, match="48"):
        OffsetAllocator(1024, alignment=48)
    with pytest.raises(InvalidValue):
        OffsetAllocator(1024, alignment=0)


def test_alignment_and_rounding() -> None:
    alloc = OffsetAllocator(4096, alignment=64)
    a = alloc.allocate(1)
    b = alloc.allocate(65)
    c = alloc.allocate(0)
    d = alloc.allocate(64)
    assert a is not None and b is not None and c is not None and d is not None
    for off in (a, b, c, d):
        assert off % 64 == 0
    assert alloc.size_of(a) == 64
    assert alloc.size_of(b) == 128
    assert alloc.size_of(c) == 64  # size 0 still takes one unit, so offsets stay distinct
    assert alloc.size_of(d) == 64
    assert len({a, b, c, d}) == 4
    assert alloc.used_bytes == 64 + 128 + 64 + 64
    check_invariants(alloc)


def test_negative_size_names_value() -> None:
    alloc = OffsetAllocator(1024)
    with pytest.raises(InvalidValue, match="-1"):
        alloc.allocate(-1)


def test_exhaustion_returns_none_and_exact_fit() -> None:
    alloc = OffsetAllocator(1024, alignment=64)
    offsets = [alloc.allocate(64) for _ in range(16)]
    assert None not in offsets
    assert alloc.free_bytes == 0
    assert alloc.allocate(1) is None
    assert alloc.allocate(0) is None
    assert alloc.fragmentation() == 0.0
    check_invariants(alloc)

    # Exact fit: a whole-capacity request on a fresh allocator succeeds, one byte more does not.
    fresh = OffsetAllocator(1024, alignment=64)
    assert fresh.allocate(1025) is None
    assert fresh.allocate(1024) == 0
    assert fresh.free_bytes == 0
    assert fresh.largest_free_bytes == 0


def test_best_fit_picks_smallest_block_that_fits() -> None:
    alloc = OffsetAllocator(64 * 20, alignment=64)
    # Layout: [a:2][b:1][c:4][d:1][e:3][f:rest]; freeing a, c, e leaves holes of 2, 4 and 3 units.
    a, b, c, d, e = (alloc.allocate(64 * n) for n in (2, 1, 4, 1, 3))
    f = alloc.allocate(alloc.free_bytes)
    assert None not in (a, b, c, d, e, f)
    assert a is not None and c is not None and e is not None
    for off in (a, c, e):
        alloc.free(off)
    # A 3-unit request must take the 3-unit hole (e), not the first hole that fits (c).
    assert alloc.allocate(64 * 3) == e
    # A 2-unit request takes the exact 2-unit hole (a).
    assert alloc.allocate(64 * 2) == a
    check_invariants(alloc)


def test_capacity_not_multiple_of_alignment() -> None:
    alloc = OffsetAllocator(100, alignment=64)
    assert alloc.allocate(1) == 0
    # 36 B remain free but no request (minimum one 64 B unit) can use them.
    assert alloc.allocate(0) is None
    assert alloc.free_bytes == 36
    assert alloc.largest_free_bytes == 0  # what fits: it said 36, room for no request at all
    check_invariants(alloc)
    odd = OffsetAllocator(1000, alignment=64)
    assert odd.largest_free_bytes == 960 and odd.allocate(960) == 0  # 1000 was said, and refused


def _three_blocks() -> tuple[OffsetAllocator, int, int, int]:
    alloc = OffsetAllocator(64 * 3, alignment=64)
    a, b, c = alloc.allocate(64), alloc.allocate(64), alloc.allocate(64)
    assert a is not None and b is not None and c is not None
    assert (a, b, c) == (0, 64, 128)
    return alloc, a, b, c


def test_coalesce_with_left_neighbour() -> None:
    alloc, a, b, c = _three_blocks()
    alloc.free(a)
    alloc.free(b)  # merges into a's free block
    assert alloc.free_blocks() == [(0, 128)]
    alloc.free(c)
    assert alloc.free_blocks() == [(0, 192)]
    assert alloc.largest_free_bytes == alloc.capacity_bytes
    check_invariants(alloc)


def test_coalesce_with_right_neighbour() -> None:
    alloc, a, b, c = _three_blocks()
    alloc.free(c)
    alloc.free(b)  # merges into c's free block
    assert alloc.free_blocks() == [(64, 128)]
    alloc.free(a)
    assert alloc.free_blocks() == [(0, 192)]
    check_invariants(alloc)


def test_coalesce_with_both_neighbours() -> None:
    alloc, a, b, c = _three_blocks()
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_blocks() == [(0, 64), (128, 64)]
    assert alloc.free(b) == 64  # merges left and right in one step
    assert alloc.free_blocks() == [(0, 192)]
    assert alloc.num_allocations == 0
    assert alloc.used_bytes == 0
    assert alloc.fragmentation() == 0.0
    check_invariants(alloc)


def test_double_free_and_unknown_offset() -> None:
    alloc = OffsetAllocator(1024, alignment=64)
    a = alloc.allocate(100)
    b = alloc.allocate(100)
    assert a is not None and b is not None
    assert alloc.free(a) == 128
    with pytest.raises(InvalidValue, match=rf"\b{a}\b.*double free"):
        alloc.free(a)
    # Inside a live allocation but not its start.
    with pytest.raises(InvalidValue, match=rf"\b{b + 64}\b"):
        alloc.free(b + 64)
    with pytest.raises(InvalidValue, match="4096"):
        alloc.free(4096)
    with pytest.raises(InvalidValue, match=rf"\b{a}\b"):
        alloc.size_of(a)
    # Errors leave the allocator untouched.
    assert alloc.num_allocations == 1
    check_invariants(alloc)


def test_randomized_alloc_free_keeps_invariants() -> None:
    rng = random.Random(1234)
    alloc = OffsetAllocator(1 << 20, alignment=256)
    live: dict[int, int] = {}  # offset -> requested size
    exhausted = 0
    for step in range(4000):
        if live and (rng.random() < 0.45 or alloc.free_bytes < 4096):
            off = rng.choice(list(live))
            reserved = alloc.size_of(off)
            assert alloc.free(off) == reserved
            del live[off]
        else:
            size = rng.choice((0, 1, 255, 256, 257, 4096)) if rng.random() < 0.3 else rng.randrange(1, 40_000)
            off = alloc.allocate(size)
            if off is None:
                exhausted += 1
                # None must mean no free block is large enough, not a bookkeeping slip.
                assert alloc.largest_free_bytes < max(256, -(-size // 256) * 256)
                continue
            assert off not in live
            assert alloc.size_of(off) >= size
            live[off] = size
        if step % 50 == 0:
            check_invariants(alloc)
            # Intervals of live allocations never overlap.
            spans = sorted((off, off + alloc.size_of(off)) for off in live)
            for (_, end), (start, _) in pairwise(spans):
                assert end <= start
    check_invariants(alloc)
    # The sequence must actually drive the arena full, or the None path above was never tested.
    assert exhausted > 0
    for off in list(live):
        alloc.free(off)
    assert alloc.free_blocks() == [(0, 1 << 20)]
    assert alloc.used_bytes == 0


def test_fragmentation_scenario() -> None:
    alloc = OffsetAllocator(64 * 32, alignment=64)
    offsets = [alloc.allocate(64) for _ in range(32)]
    assert None not in offsets
    assert alloc.fragmentation() == 0.0  # nothing free
    evens = [off for i, off in enumerate(offsets) if i % 2 == 0 and off is not None]
    odds = [off for i, off in enumerate(offsets) if i % 2 == 1 and off is not None]
    for off in evens:
        alloc.free(off)
    # 16 isolated one-unit holes: lots free, but no two-unit request fits.
    assert alloc.free_bytes == 64 * 16
    assert alloc.largest_free_bytes == 64
    assert alloc.largest_free_bytes < alloc.free_bytes
    assert alloc.fragmentation() == pytest.approx(1 - 1 / 16)
    assert alloc.allocate(128) is None
    check_invariants(alloc)
    for off in odds:
        alloc.free(off)
    assert alloc.fragmentation() == 0.0
    assert alloc.free_blocks() == [(0, 64 * 32)]
    check_invariants(alloc)


class ListBestFit:
    """The rule the allocator keeps, the slow way: the smallest free block that fits, the lowest
    offset among equal sizes, and a freed block merged with free neighbours on both sides."""

    def __init__(self, capacity: int, alignment: int) -> None:
        self.alignment = alignment
        self.free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), by offset
        self.live: dict[int, int] = {}

    def allocate(self, size: int) -> int | None:
        need = max(self.alignment, -(-size // self.alignment) * self.alignment)
        fits = [(s, o) for o, s in self.free if s >= need]
        if not fits:
            return None
        block, offset = min(fits)
        self.free.remove((offset, block))
        if block > need:
            self.free.append((offset + need, block - need))
            self.free.sort()
        self.live[offset] = need
        return offset

    def free_at(self, offset: int) -> None:
        start, end = offset, offset + self.live.pop(offset)
        for o, s in list(self.free):
            if o + s == start or o == end:
                self.free.remove((o, s))
                start, end = min(start, o), max(end, o + s)
        self.free.append((start, end - start))
        self.free.sort()


@pytest.mark.parametrize("sizes", ["one-size", "few-sizes", "any-size"])
def test_every_choice_matches_the_best_fit_rule_under_churn(sizes: str) -> None:
    """Blocks of one size freed out of order, then taken again (a heap entry per block, most of
    them left behind by merges), checked step by step against ListBestFit."""
    rng = random.Random(sizes)
    alloc, model = OffsetAllocator(1 << 20, alignment=64), ListBestFit(1 << 20, 64)
    pick = {
        "one-size": lambda: 4096,
        "few-sizes": lambda: rng.choice((1000, 4096, 5000, 64)),
        "any-size": lambda: rng.randrange(1, 20_000),
    }[sizes]
    for step in range(3000):
        if model.live and (rng.random() < 0.5 or step % 400 > 300):
            off = rng.choice(sorted(model.live))
            model.free_at(off)
            alloc.free(off)
        else:
            size = pick()
            assert alloc.allocate(size) == model.allocate(size), f"step {step}: allocate({size})"
        assert alloc.free_blocks() == model.free, f"step {step}"
    check_invariants(alloc)


def test_blocks_that_merge_away_leave_their_size_heap_and_choices_stay_best_fit() -> None:
    """100 one-unit holes, then the blocks between them freed from the top: each free merges two
    holes away. Their heap entries go with them (no heap holds more entries than free blocks of
    its size), and every choice still follows the rule."""
    alloc, model = OffsetAllocator(64 * 200, alignment=64), ListBestFit(64 * 200, 64)
    offsets = [alloc.allocate(64) for _ in range(200)]
    assert offsets == [model.allocate(64) for _ in range(200)]
    for off in offsets[::2]:
        alloc.free(off)
        model.free_at(off)
    for off in reversed(offsets[1::2][40:]):  # 60 merges of three blocks into one
        alloc.free(off)
        model.free_at(off)
        sizes = [s for _, s in alloc.free_blocks()]
        assert {size: len(heap) for size, heap in alloc._at_size.items()} == {s: sizes.count(s) for s in set(sizes)}
    for _ in range(50):  # take the lowest hole and give it back
        off = alloc.allocate(64)
        assert off == model.allocate(64) == 0
        alloc.free(off)
        model.free_at(off)
    assert len(alloc._at_size[64]) == 40
    assert alloc.free_blocks() == model.free
    check_invariants(alloc)
