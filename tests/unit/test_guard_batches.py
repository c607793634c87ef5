"""index/pressure.py guard_batches: how move_replicas cuts a long list of moves into Lua calls. A
call deletes the guards it used, so moves that share a guard must go in one call; the cut is a
pure function, tested here on tables of moves, and move_replicas refuses what cannot be cut so
before it sends anything."""

from __future__ import annotations

import pytest

from mooncake_store.errors import InvalidValue, MooncakeError
from mooncake_store.index.pressure import guard_batches
from mooncake_store.types import Replica, ReplicaState, TierKind

NEW = Replica(node_id="b", tier=TierKind.HOST, offset=0, size_bytes=1, alloc_id=1, state=ReplicaState.COMPLETE)


def moves_of(guards: str) -> list[tuple[str, int, Replica, str]]:
    """One move per letter, its guard the letter ("." for none)."""
    return [(f"k{i}", i, NEW, "" if g == "." else g) for i, g in enumerate(guards)]


def guards_of(batches: list) -> list[str]:  # type: ignore[type-arg]
    return ["".join(m[3] or "." for m in batch) for batch in batches]


@pytest.mark.parametrize(
    ("guards", "size", "cut"),
    [
        ("", 3, []),
        ("aaa", 3, ["aaa"]),
        ("aabbb", 3, ["aa", "bbb"]),  # a plain cut at 3 would split b
        ("abbbc", 3, ["a", "bbb", "c"]),
        ("aab.", 3, ["aab", "."]),
        ("......", 4, ["....", ".."]),  # moves without a guard are cut anywhere
        ("a..bb", 3, ["a..", "bb"]),
        ("aba", 3, ["aba"]),  # apart, but in one call
        ("aabbcc", 4, ["aabb", "cc"]),
    ],
)
def test_moves_sharing_a_guard_go_in_one_call(guards: str, size: int, cut: list[str]) -> None:
    batches = guard_batches(moves_of(guards), size)
    assert guards_of(batches) == cut
    assert [m for batch in batches for m in batch] == moves_of(guards)  # in order, each once
    assert all(len(batch) <= size for batch in batches)


def test_more_moves_under_one_guard_than_a_call_takes_are_refused_with_the_count_and_the_limit() -> None:
    with pytest.raises(InvalidValue, match=r"4 moves share the guard 'a': one call takes at most 3"):
        guard_batches(moves_of("aaaa"), 3)


def test_a_guard_whose_moves_a_cut_would_part_is_refused() -> None:
    with pytest.raises(MooncakeError, match=r"guard 'a' are not next to each other: .* at most 3"):
        guard_batches(moves_of("abba"), 3)
