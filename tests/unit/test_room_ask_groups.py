"""A writer asking a node for room for a replicated batch asks once per group of objects whose
other replicas are on the same nodes, each with its own marks (client/reserving.py
room_ask_groups): asked once with the union of every object's marks, a batch whose second replicas
spread over every other node spared them all, and the node evicted while they had room."""

from __future__ import annotations

from mooncake_store.client.buffers import as_source
from mooncake_store.client.put_plans import PlannedPut
from mooncake_store.client.reserving import room_ask_groups
from mooncake_store.transport import frames
from mooncake_store.types import Replica, TierKind


def plan(key: str, *others: str) -> PlannedPut:
    return PlannedPut(key=key, source=as_source(b"x"), put_id=key.encode(), assigned={"a", *others})


def test_the_room_asks_of_a_batch_group_its_objects_by_the_nodes_of_their_other_replicas() -> None:
    spread = [plan("1", "b"), plan("2", "c"), plan("3", "b"), plan("4", "b", "c")]
    asks = room_ask_groups(2, spread, "a")
    assert [[p.key for p in group] for _, group in asks] == [["1", "3"], ["2"], ["4"]]  # in the plans' order
    assert [flags for flags, _ in asks] == [
        frames.replicated_flags(["b"]),
        frames.replicated_flags(["c"]),
        frames.replicated_flags(["b", "c"]),
    ]
    assert room_ask_groups(1, spread, "a") == [(0, spread)]  # one replica: a plain ask, nothing spared


def test_objects_whose_other_nodes_share_their_marks_are_one_ask() -> None:
    same = [plan("1", "b"), plan("2", "b")]
    assert room_ask_groups(3, same, "a") == [(frames.replicated_flags(["b"]), same)]
    # A replica reserved already counts as an assigned one; the node asked is never among the marks.
    held = plan("3")
    held.replicas.append(Replica(node_id="c", tier=TierKind.HOST, offset=0, size_bytes=1, alloc_id=1))
    assert room_ask_groups(2, [held], "a") == [(frames.replicated_flags(["c"]), [held])]
    assert room_ask_groups(2, [plan("5")], "a") == [(frames.replicated_flags([]), [plan("5")])]
