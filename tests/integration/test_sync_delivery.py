"""agent_sync.lua delivers acks and graves at least once: what a reply carried comes again until
the agent's next sync says it applied that reply (a reply lost in a stall of the server must not
take an ack or a grave with it). Against the real server, through the index client's own calls."""

from __future__ import annotations

from mooncake_store.index.client import RedisIndex


def test_acks_and_graves_come_again_until_a_sync_confirms_them(redis_url: str, namespace: str) -> None:
    index = RedisIndex(redis_url, namespace=namespace)
    node = "n1"
    try:
        acks, graves = index.prefix + "acks:" + node, index.prefix + "gc:" + node
        index.redis.rpush(acks, "11", "12\tsome/key")
        index.redis.zadd(graves, {"21": 0, "22": 0, "23": index.server_time_ms() + 3_600_000})

        first = index.agent_sync(node, expired_put_ids=[], applied_last=True)
        assert first.acked_alloc_ids == [11, 12] and first.acked_keys == {12: "some/key"}
        assert first.graves == [21, 22]  # 23 is not due

        # That reply was lost: the next sync carries it again, with what came since.
        index.redis.rpush(acks, "13")
        again = index.agent_sync(node, expired_put_ids=[], applied_last=False)
        assert again.acked_alloc_ids == [11, 12, 13] and again.graves == [21, 22]

        # Applied: the next sync carries only what is new; then nothing.
        index.redis.rpush(acks, "14")
        assert index.agent_sync(node, expired_put_ids=[], applied_last=True).acked_alloc_ids == [14]
        final = index.agent_sync(node, expired_put_ids=[], applied_last=True)
        assert final.acked_alloc_ids == [] and final.graves == []
        assert index.redis.zrange(graves, 0, -1) == ["23"]  # not due: still waiting in the graveyard
    finally:
        index.close()


def test_a_sync_delivers_at_most_max_graves_including_unconfirmed_ones(redis_url: str, namespace: str) -> None:
    index = RedisIndex(redis_url, namespace=namespace)
    try:
        index.redis.zadd(index.prefix + "gc:n1", {str(g): 0 for g in range(10)})
        assert len(index.agent_sync("n1", expired_put_ids=[], applied_last=True, max_graves=4).graves) == 4
        # Unconfirmed: the same 4 again, and no more (the reply stays bounded).
        assert len(index.agent_sync("n1", expired_put_ids=[], applied_last=False, max_graves=4).graves) == 4
        assert len(index.agent_sync("n1", expired_put_ids=[], applied_last=True, max_graves=4).graves) == 4
        assert index.redis.zcard(index.prefix + "gc:n1") == 2
    finally:
        index.close()
