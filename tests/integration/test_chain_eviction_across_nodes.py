"""Chains spread over nodes under pressure: a chunk whose later chunks live on another node may not
be evicted alone (its chain would lose its middle), and that node may be under its own watermark,
never evicting them. A pass that can move nothing else evicts such a chunk with its later chunks
(evict_chains.lua), those nearest a chain's tail first."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from index_audit import settled_audit

from mooncake_store import Client, LocalCluster

MiB = 1 << 20


def chunk(i: int) -> np.ndarray:
    return np.full(MiB, i % 251, np.uint8)


def put_alternating_chain(client: Client, keys: list[str], nodes: list[str]) -> None:
    """One chunk per put, each on the next node in turn: the chain's parents and children are
    on different nodes."""
    for i, key in enumerate(keys):
        client.put_many(
            {key: chunk(i)},
            preferred_node=nodes[i % len(nodes)],
            chain_pos={key: i},
            chain_parent={key: keys[i - 1]} if i else None,
        )


def test_a_put_to_a_node_of_chain_parents_evicts_the_chain_tail_on_the_other_node(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Both nodes at 14 of 16 MiB, under their high watermarks (90 %), every chunk on one node the
    parent of a chunk on the other. A 3 MiB put pinned to agent-0 needs one chunk to go there; each
    of its chunks may only go after its child on agent-1, which agent-1 (not under pressure) never
    evicts, and the spill ceiling keeps agent-1 from taking one. The put failed with NoCapacity
    after its whole timeout, with the cluster full of evictable chunks."""
    cluster = make_cluster(2, host_bytes=16 * MiB)
    client = make_client(cluster, timeout_s=8)
    nodes = [agent.node_id for agent in cluster.agents]
    keys = [f"x/{i:02d}" for i in range(28)]
    put_alternating_chain(client, keys, nodes)
    big = np.arange(3 * MiB, dtype=np.uint8)
    client.put("big", big, preferred_node=nodes[0])
    assert np.array_equal(client.get("big"), big)
    # agent-0 is past its high watermark now (13 chunks and the put's 3 MiB) and drains to its low
    # one the same way: wait for the moves to end, then look.
    assert not settled_audit(client.index)
    present = [client.exists(k) for k in keys]
    # Prefix-closed: the chain lost its tail only, and no more than the drain needed.
    assert present == sorted(present, reverse=True), present
    assert not present[-1] and all(present[:16]), present
    for i, (key, ok) in enumerate(zip(keys, present, strict=True)):
        if ok:
            assert np.array_equal(client.get(key), chunk(i))
    assert client.stat().evictions == present.count(False)


def test_evict_chains_takes_a_chunk_with_its_later_chunks_only_when_none_is_pinned_or_read(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, host_bytes=32 * MiB)
    client = make_client(cluster)
    reader = make_client(cluster, lease_ms=60_000)
    nodes = [agent.node_id for agent in cluster.agents]
    keys = [f"p/{i}" for i in range(5)]  # p/0, p/2, p/4 on agent-0; p/1, p/3 on agent-1
    put_alternating_chain(client, keys, nodes)
    index, redis, prefix = client.index, client.index.redis, client.index.prefix

    def candidate(key: str) -> tuple[str, int]:
        meta = client.object_meta(key)
        assert meta is not None
        return key, meta.replicas[0].alloc_id

    def evict(keys_: list[str], wanted: int = MiB, most: int = 64) -> tuple[int, int, list[str]]:
        return index.evict_chains(
            [candidate(k) for k in keys_], node_id=nodes[0], tier="host", wanted_bytes=wanted, most_later=most
        )

    # A later chunk pinned (a prefix match holds it): nothing goes.
    redis.zadd(prefix + "pins:p/3", {"test-pin": index.server_time_ms() + 60_000})
    assert evict(["p/2"]) == (0, 0, ["PINNED"])
    redis.delete(prefix + "pins:p/3")
    # A later chunk read under a live lease: nothing goes.
    reader.get("p/4")
    assert evict(["p/2"]) == (0, 0, ["LEASED"])
    # More later chunks than allowed: kept.
    assert evict(["p/0"], most=3) == (0, 0, ["LONG"])
    assert all(client.exists(k) for k in keys)
    # A chain nobody reads:
    tail = [f"q/{i}" for i in range(4)]  # q/0, q/2 on agent-0; q/1, q/3 on agent-1
    put_alternating_chain(client, tail, nodes)
    # Fewest later chunks first: q/2 (q/3 after it) goes, q/0 is not needed for 1 MiB.
    freed, evicted, statuses = evict(["q/0", "q/2"])
    assert (freed, evicted, statuses) == (MiB, 2, ["SKIPPED", "OK"])
    assert [client.exists(k) for k in tail] == [True, True, False, False]
    # A count that disagrees with its set (as an index written before the sets existed): kept.
    redis.hincrby(prefix + "children", "q/1", 1)
    assert evict(["q/0"])[2] == ["PARENT"]
    redis.hdel(prefix + "children", "q/1")
    # Asked for 2 MiB, q/0 goes with q/1: the chain is gone, and so is its parent's count.
    assert evict(["q/0"], wanted=2 * MiB) == (MiB, 2, ["OK"])
    assert not any(client.exists(k) for k in tail)
    assert redis.hget(prefix + "children", "q/0") is None and not redis.exists(prefix + "kids:q/0")
    assert not settled_audit(client.index)
