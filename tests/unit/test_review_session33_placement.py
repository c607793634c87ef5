"""Placement of a put's further replicas on nodes that keep the object (review, thirty-third
session): a node holding a copy is no target for another copy of the same object, so a copy on a
node that does not keep it (kept_bytes) is evicted by that node's next pressure pass."""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_store.errors import NoCapacity
from mooncake_store.policy.eviction import MoveKind, choose_move
from mooncake_store.policy.placement import check_kept, choose_replica_nodes, left_out_nodes
from mooncake_store.types import NodeInfo, TierKind
from tests.unit.test_policy import NOW, MiB, node


def watermarked(n: NodeInfo, high: str) -> NodeInfo:
    return dataclasses.replace(n, labels={"high_watermark": high})


def test_replicas_need_as_many_nodes_that_keep_the_object() -> None:
    """Two live nodes, one of which keeps a 0.94 MiB object (the other's 0.9 watermark of 1 MiB
    does not): replicas=1 is stored, replicas=2 is refused at once, naming the size, the nodes that
    keep it, and what the other keeps."""
    small = watermarked(node("small", free=MiB, capacity=MiB), "0.9")
    big = watermarked(node("big", free=4 * MiB, capacity=4 * MiB), "0.9")
    size = 960 << 10
    check_kept([small, big], size_bytes=size, now_ms=NOW, replicas=1)
    with pytest.raises(NoCapacity) as info:
        check_kept([small, big], size_bytes=size, now_ms=NOW, replicas=2)
    message = str(info.value)
    assert info.value.permanent
    assert "replicas=2" in message and str(size) in message and "only 1 do (big)" in message
    assert f"small {int(0.9 * MiB) // 64 * 64} B" in message, message
    # Three nodes, two of which keep it: stored.
    check_kept([small, big, dataclasses.replace(big, node_id="big2")], size_bytes=size, now_ms=NOW, replicas=2)
    # Fewer live nodes than replicas: choose_replica_nodes says so, with its count.
    check_kept([big], size_bytes=size, now_ms=NOW, replicas=2)


def test_further_replicas_go_to_nodes_that_keep_the_object_first() -> None:
    """A node on another host that does not keep the object loses to one on the same host that
    does: the first would evict its copy."""
    nodes = [node("mine", free=8 * MiB), node("mine-2", free=8 * MiB), node("far-small", free=MiB, host="h2")]
    picked = choose_replica_nodes(nodes, 2, keeps=lambda n: n.node_id != "far-small")
    assert [n.node_id for n in picked] == ["mine", "mine-2"]
    # Without the rule, hosts apart win, as before.
    assert [n.node_id for n in choose_replica_nodes(nodes, 2)] == ["mine", "far-small"]


def test_a_refusal_for_too_few_nodes_says_why_the_others_were_left_out() -> None:
    ranked = [node("big", free=4 * MiB, capacity=4 * MiB)]
    listed = [*ranked, node("small", free=MiB, capacity=MiB), node("dead", free=8 * MiB, alive=False)]
    size = MiB + (64 << 10)

    def why() -> str:
        return left_out_nodes(listed, ranked, size_bytes=size, now_ms=NOW, tier=TierKind.HOST)

    with pytest.raises(NoCapacity) as info:
        choose_replica_nodes(ranked, 2, left_out=why)
    message = str(info.value)
    assert f"small ({MiB} B of host in all, under {size} B)" in message, message
    assert "dead (past its heartbeat deadline)" in message


def test_a_malformed_published_watermark_is_taken_as_absent() -> None:
    """A high_watermark label that is no number failed every pressure pass that planned by it
    (choose_move read it raw); it now counts as not published."""
    peer = watermarked(node("peer", free=8 * MiB, capacity=8 * MiB, host="h2"), "lots")
    move = choose_move(
        MiB,
        tier=TierKind.HOST,
        node_id="me",
        zone="z1",
        lower_tier=None,
        lower_free_bytes=0,
        peers=[peer],
        now_ms=NOW,
        high_watermark=0.9,
    )
    assert move.kind == MoveKind.SPILL and move.node_id == "peer"
    assert peer.high_watermark(0.8) == 0.8
    assert watermarked(peer, "nan").high_watermark(0.8) == 0.8
    assert watermarked(peer, "0.5").high_watermark(0.8) == 0.5
