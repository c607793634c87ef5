"""agent_sync.lua delivers acks and graves at least once: what a reply carried comes again until
the agent's next sync says it applied that reply (a reply lost in a stall of the server must not
take an ack or a grave with it). Against the real server, through the index client's own calls."""

from __future__ import annotations

import json

import pytest

from mooncake_store.index.client import NodeSuperseded, RedisIndex, SyncResult


def sync(index: RedisIndex, node: str, *, applied_last: bool = True, max_graves: int = 1000) -> SyncResult:
    return index.agent_sync(
        node, incarnation="inc-1", expired_put_ids=[], applied_last=applied_last, max_graves=max_graves
    )


def own_record(index: RedisIndex, node: str, incarnation: str = "inc-1") -> None:
    """The node's row as its agent registered it (the sync checks the incarnation in it)."""
    index.redis.hset(index.prefix + "nodes", node, json.dumps({"node_id": node, "incarnation": incarnation}))


def test_acks_and_graves_come_again_until_a_sync_confirms_them(redis_url: str, namespace: str) -> None:
    index = RedisIndex(redis_url, namespace=namespace)
    node = "n1"
    try:
        own_record(index, node)
        acks, graves = index.prefix + "acks:" + node, index.prefix + "gc:" + node
        index.redis.rpush(acks, "11", "12\tsome/key")
        index.redis.zadd(graves, {"21": 0, "22": 0, "23": index.server_time_ms() + 3_600_000})

        first = sync(index, node)
        assert first.acked_alloc_ids == [11, 12] and first.acked_keys == {12: "some/key"}
        assert first.graves == [21, 22]  # 23 is not due

        # That reply was lost: the next sync carries it again, with what came since.
        index.redis.rpush(acks, "13")
        again = sync(index, node, applied_last=False)
        assert again.acked_alloc_ids == [11, 12, 13] and again.graves == [21, 22]

        # Applied: the next sync carries only what is new; then nothing.
        index.redis.rpush(acks, "14")
        assert sync(index, node).acked_alloc_ids == [14]
        final = sync(index, node)
        assert final.acked_alloc_ids == [] and final.graves == []
        assert index.redis.zrange(graves, 0, -1) == ["23"]  # not due: still waiting in the graveyard
    finally:
        index.close()


def test_a_sync_delivers_at_most_max_graves_including_unconfirmed_ones(redis_url: str, namespace: str) -> None:
    index = RedisIndex(redis_url, namespace=namespace)
    try:
        own_record(index, "n1")
        index.redis.zadd(index.prefix + "gc:n1", {str(g): 0 for g in range(10)})
        assert len(sync(index, "n1", max_graves=4).graves) == 4
        # Unconfirmed: the same 4 again, and no more (the reply stays bounded).
        assert len(sync(index, "n1", applied_last=False, max_graves=4).graves) == 4
        assert len(sync(index, "n1", max_graves=4).graves) == 4
        assert index.redis.zcard(index.prefix + "gc:n1") == 2
    finally:
        index.close()


def test_a_superseded_incarnation_cannot_drain_the_acks_of_its_successor(redis_url: str, namespace: str) -> None:
    """A stalled agent whose node id was taken over (or reaped) must not take the acks and graves
    that belong to the record's incarnation."""
    index = RedisIndex(redis_url, namespace=namespace)
    try:
        own_record(index, "n1", incarnation="new")
        index.redis.rpush(index.prefix + "acks:n1", "41")
        with pytest.raises(NodeSuperseded, match="not incarnation old"):
            index.agent_sync("n1", incarnation="old", expired_put_ids=[], applied_last=True)
        assert index.agent_sync("n1", incarnation="new", expired_put_ids=[], applied_last=True).acked_alloc_ids == [41]
        index.redis.hdel(index.prefix + "nodes", "n1")  # reaped
        with pytest.raises(NodeSuperseded):
            index.agent_sync("n1", incarnation="new", expired_put_ids=[], applied_last=True)
    finally:
        index.close()
