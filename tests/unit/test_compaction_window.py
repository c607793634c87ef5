"""The compaction's choice of window (policy/compaction.py) on tables of blocks, and the allocator's
take(), which holds the window's free pieces."""

from __future__ import annotations

import pytest

from mooncake_store.errors import InvalidValue
from mooncake_store.policy.compaction import Block, choose_window
from mooncake_store.tiers.allocator import OffsetAllocator

U = 64  # one unit, in these tables


def _arena(layout: str) -> list[Block]:
    """One character per unit: '.' free, a digit a movable allocation (a run of the same digit is
    one), 'X' one that may not move; ids from the digits (X: 100 + offset)."""
    blocks: list[Block] = []
    i = 0
    while i < len(layout):
        ch = layout[i]
        j = i
        while j < len(layout) and layout[j] == ch and ch != "X":
            j += 1
        j = max(j, i + 1)
        if ch == ".":
            blocks.append(Block(i * U, (j - i) * U))
        elif ch == "X":
            blocks.append(Block(i * U, U, alloc_id=100 + i))
        else:
            blocks.append(Block(i * U, (j - i) * U, alloc_id=int(ch), movable=True))
        i = j
    return blocks


def _moved(layout: str, units: int) -> tuple[int, list[int]] | None:
    window = choose_window(_arena(layout), units * U)
    if window is None:
        return None
    return window.start // U, [block.alloc_id for block in window.moves]  # type: ignore[misc]


def test_the_window_that_moves_the_fewest_bytes_is_chosen() -> None:
    # Windows of two units over 11 or 44 move two; the ones over 3 move one, the lowest at 3.
    assert _moved(".11.3.44.", 2) == (3, [3])


def test_among_windows_of_equal_cost_the_lowest_offset_wins() -> None:
    assert _moved(".1.2.3.", 2) == (0, [1])


def test_an_object_that_may_not_move_is_never_in_the_window() -> None:
    assert _moved(".X.1.X.", 2) == (2, [1])
    assert _moved("X.X1X.X", 2) is None  # every window of two holds an X


def test_an_object_across_the_windows_end_moves_whole_and_must_fit_whole() -> None:
    # [0, 3) takes the first unit of 11, which moves whole into the two-unit hole at 7.
    window = choose_window(_arena("..11X.X..X"), 3 * U)
    assert window is not None and window.start == 0 and window.moved_bytes == 2 * U
    # Here 111 fits none of the one-unit holes outside: counted by the unit the window takes of
    # it, it would have seemed to.
    assert _moved(".111.X.X.X", 2) is None


def test_the_moved_objects_must_fit_outside_the_window() -> None:
    assert _moved(".1X.X", 2) == (0, [1])  # 1 goes to the hole at 3
    assert _moved(".11X", 2) is None  # 11 fits nowhere but in its own window
    assert _moved("22.3X..X.X", 3) == (0, [2])  # 22 into the two-unit hole at 5


def test_nothing_to_do_and_nothing_possible() -> None:
    assert choose_window([], U) is None
    assert choose_window(_arena("...."), 0) is None
    assert choose_window(_arena("XXXX"), U) is None
    assert choose_window(_arena(".1."), 4 * U) is None  # larger than the arena


def test_take_holds_exactly_the_range_inside_a_free_block() -> None:
    alloc = OffsetAllocator(16 * U, alignment=U)
    first = alloc.allocate(4 * U)
    assert first == 0
    alloc.take(6 * U, 2 * U)
    assert alloc.free_blocks() == [(4 * U, 2 * U), (8 * U, 8 * U)]
    assert alloc.used_bytes == 6 * U
    with pytest.raises(InvalidValue, match="not inside one free block"):
        alloc.take(5 * U, 2 * U)  # runs into the held piece
    with pytest.raises(InvalidValue, match="not whole units"):
        alloc.take(8 * U + 1, U)
    alloc.free(6 * U)
    alloc.free(first)
    assert alloc.free_blocks() == [(0, 16 * U)]
