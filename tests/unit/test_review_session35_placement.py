"""Placement outside the writer's zone (README, Placement: "else to the node with the most room"):
rank_nodes ordered every node by the share of its tier in use, so outside the zone a small node
nearly empty went before a large one with fifty times its free bytes. In the writer's zone the
least loaded node still goes first."""

from __future__ import annotations

from test_policy import NOW, MiB, node

from mooncake_store.policy.placement import rank_nodes


def test_outside_the_writer_s_zone_the_node_with_the_most_room_goes_first() -> None:
    nodes = [
        node("small-empty", free=90 * MiB, capacity=100 * MiB, host="h2", zone="z2"),
        node("big-half", free=5000 * MiB, capacity=10000 * MiB, host="h3", zone="z2"),
    ]
    ranked = rank_nodes(nodes, size_bytes=MiB, now_ms=NOW, host_id="h1", zone="z1")
    assert [n.node_id for n in ranked] == ["big-half", "small-empty"]


def test_in_the_writer_s_zone_the_least_loaded_node_goes_first_and_before_other_zones() -> None:
    nodes = [
        node("big-half", free=5000 * MiB, capacity=10000 * MiB, host="h3", zone="z1"),
        node("small-empty", free=90 * MiB, capacity=100 * MiB, host="h2", zone="z1"),
        node("far-huge", free=90000 * MiB, capacity=100000 * MiB, host="h4", zone="z2"),
    ]
    ranked = rank_nodes(nodes, size_bytes=MiB, now_ms=NOW, host_id="h1", zone="z1")
    assert [n.node_id for n in ranked] == ["small-empty", "big-half", "far-huge"]
