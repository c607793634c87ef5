"""A batch the live nodes cannot hold all at once, however empty (its reservations are all held
until it commits), waited out timeout_s and then blamed pinned and leased objects that did not
exist: 3 x 600 KiB, or 5 x 400 KiB, on two 1 MiB agents (README walk-through, session 30)."""

from __future__ import annotations

import dataclasses

import pytest
from test_policy import NOW, node

from mooncake_store.errors import NoCapacity
from mooncake_store.policy.placement import check_batch_fits

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize(
    ("sizes", "replicas", "fits"),
    [
        ([600 * KiB] * 2, 1, True),
        ([600 * KiB] * 3, 1, False),  # one per node: nothing fills the rest of a node
        ([400 * KiB] * 4, 1, True),
        ([400 * KiB] * 5, 1, False),  # two per node at most
        ([900 * KiB, 100 * KiB, 100 * KiB, 100 * KiB], 1, True),  # the small ones pack
        ([300 * KiB] * 3, 2, True),  # six copies, three per node
        ([300 * KiB] * 4, 2, False),
        ([MiB // 64] * 128, 1, True),  # exactly full, in whole 64 B units
        ([MiB // 64 + 1] * 128, 1, False),  # each rounds up to one unit more
    ],
)
def test_a_batch_is_refused_at_once_only_when_no_layout_could_hold_it(
    sizes: list[int], replicas: int, fits: bool
) -> None:
    nodes = [node("a", free=MiB, capacity=MiB), node("b", free=0, capacity=MiB), node("dead", free=MiB, alive=False)]
    if fits:
        check_batch_fits(nodes, sizes, replicas=replicas, now_ms=NOW)
    else:
        with pytest.raises(NoCapacity, match=r"cannot be held at once.*a 1048576 B, b 1048576 B\)") as caught:
            check_batch_fits(nodes, sizes, replicas=replicas, now_ms=NOW)
        assert caught.value.permanent


def test_a_preferred_node_is_judged_alone_for_the_first_copies() -> None:
    nodes = [node("a", free=MiB, capacity=MiB), node("b", free=MiB, capacity=100 * MiB)]
    check_batch_fits(nodes, [600 * KiB] * 3, replicas=1, now_ms=NOW, preferred_node="b")
    with pytest.raises(NoCapacity, match=r"\(a 1048576 B\) hold at most 1 of the 3 objects"):
        check_batch_fits(nodes, [600 * KiB] * 3, replicas=1, now_ms=NOW, preferred_node="a")
    with pytest.raises(NoCapacity, match=r"\(a 1048576 B\) hold at most 1 of the 3 copies"):
        check_batch_fits(nodes, [600 * KiB] * 3, replicas=2, now_ms=NOW, preferred_node="b")
    check_batch_fits(nodes, [600 * KiB], replicas=1, now_ms=NOW, preferred_node="a")  # one object: not judged here


def test_more_replicas_than_live_nodes_is_left_to_the_replica_rule() -> None:
    """It said "put it in smaller batches", and a batch of one then failed on "replicas=2 needs 2
    live nodes" (diff review): that rule names the cause, in choose_replica_nodes."""
    nodes = [node("a", free=MiB, capacity=MiB), node("dead", free=MiB, capacity=MiB, alive=False)]
    check_batch_fits(nodes, [100 * KiB] * 2, replicas=2, now_ms=NOW)


@pytest.mark.parametrize(
    ("sizes", "replicas", "preferred", "limit"),
    [
        ([600 * KiB] * 3, 1, None, 2),  # one per node
        ([400 * KiB] * 7, 1, None, 4),
        ([500 * KiB] * 5, 1, None, 4),
        ([300 * KiB] * 4, 2, None, 3),
        ([600 * KiB] * 3, 1, "a", 1),  # the preferred node alone holds the first copies
    ],
)
def test_a_refused_batch_says_how_many_of_its_first_objects_would_fit(
    sizes: list[int], replicas: int, preferred: str | None, limit: int
) -> None:
    """A prompt's store writes that many (PrefixCache.store): told only to use smaller batches, a
    caller who chose no batch stored nothing (a prefix-cache probe, 2026-12-07)."""
    nodes = [node("a", free=MiB, capacity=MiB), node("b", free=0, capacity=MiB)]
    with pytest.raises(NoCapacity, match=rf"its first {limit} would be kept") as caught:
        check_batch_fits(nodes, sizes, replicas=replicas, now_ms=NOW, preferred_node=preferred)
    assert caught.value.batch_limit == limit
    check_batch_fits(nodes, sizes[:limit], replicas=replicas, now_ms=NOW, preferred_node=preferred)


def test_a_batch_with_an_object_no_arena_holds_is_left_to_the_per_object_rule() -> None:
    """Any second key turned "need 2 MiB on host; the largest host arena is 1 MiB" into "put it in
    smaller batches", which could never succeed (a prefix-cache probe): rank_nodes names it."""
    nodes = [node("a", free=MiB, capacity=MiB), node("b", free=MiB, capacity=MiB)]
    check_batch_fits(nodes, [2 * MiB, KiB], replicas=1, now_ms=NOW)


def test_the_limit_is_what_the_nodes_keep_under_their_high_watermarks() -> None:
    """Cut to fill the arenas whole, a prompt's store waited for every other object to go, and
    one leased object anywhere left it waiting out its timeout (review of the change above)."""
    marked = [
        dataclasses.replace(node(n, free=MiB, capacity=MiB), labels={"high_watermark": "0.5"}) for n in ("a", "b")
    ]
    with pytest.raises(NoCapacity, match=r"its first 4 would be kept") as caught:
        check_batch_fits(marked, [256 * KiB] * 9, replicas=1, now_ms=NOW)
    assert caught.value.batch_limit == 4  # two of 256 KiB under each 512 KiB mark


def test_an_object_larger_than_the_preferred_node_is_left_to_the_per_object_rule() -> None:
    """It was told "put it in smaller batches (its first 0 would fit)" (review)."""
    nodes = [node("a", free=MiB, capacity=MiB), node("b", free=4 * MiB, capacity=4 * MiB)]
    check_batch_fits(nodes, [2 * MiB, KiB], replicas=1, now_ms=NOW, preferred_node="a")


def test_bytes_held_on_a_node_are_no_room_for_the_batch() -> None:
    """The stored chain a prompt's store extends stays while its new chunks are written (the store
    pins the chunk they hang off): counted as room, the new chunks of a prompt longer than the
    cluster, stored again, waited out the timeout for room only that chain held (a probe)."""
    nodes = [node("a", free=0, capacity=MiB), node("b", free=0, capacity=MiB)]
    check_batch_fits(nodes, [256 * KiB] * 7, replicas=1, now_ms=NOW)  # empty, they hold 8
    held = {"a": 768 * KiB, "b": 256 * KiB}
    with pytest.raises(NoCapacity, match=r"even empty but for the 1048576 B that stay there") as caught:
        check_batch_fits(nodes, [256 * KiB] * 7, replicas=1, now_ms=NOW, held_bytes=held)
    assert caught.value.batch_limit == 4  # no marks published: one beside a's 768 KiB, three beside b's
    check_batch_fits(nodes, [256 * KiB] * 3, replicas=1, now_ms=NOW, held_bytes=held)  # a 1, b 3 at most
