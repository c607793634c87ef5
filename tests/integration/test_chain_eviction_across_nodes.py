"""Chains spread over nodes under pressure: a chunk whose later chunks live on another node may not
be evicted alone (its chain would lose its middle), and that node may be under its own watermark,
never evicting them. A pass that can move nothing else evicts such a chunk with its later chunks
(evict_chains.lua), those nearest a chain's tail first; not one whose later chunks are on another
tier of its own node, which that tier's pass moves first."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
from helpers import wait_until
from index_audit import settled_audit

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

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


def drain_ended(client: Client, still_s: float = 1.5) -> bool:
    """Whether no eviction came for ``still_s`` (pressure passes run every 0.2 s while a drain lasts)."""
    before = client.stat().evictions
    time.sleep(still_s)
    return client.stat().evictions == before


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
    # one the same way, pass after pass: wait for the evictions to stop (one settled audit came
    # between two passes of a drain once, and a chunk present when looked at went before its read).
    assert wait_until(lambda: drain_ended(client), 30), "the drain never ended"
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
        freed, evicted, statuses, _ = index.evict_chains(
            [candidate(k) for k in keys_], node_id=nodes[0], tier="host", wanted_bytes=wanted, most_later=most
        )
        return freed, evicted, statuses

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
    # In the order given, each chain cut back from its leaves as far as wanted: for 1 MiB q/0's
    # chain loses q/3 (on agent-1: nothing freed here) and q/2, and q/0 stays (q/2 is gone then).
    freed, evicted, statuses = evict(["q/0", "q/2"])
    assert (freed, evicted, statuses) == (MiB, 2, ["TRIMMED", "GONE"])
    assert [client.exists(k) for k in tail] == [True, True, False, False]
    # A count that disagrees with its set (as an index written before the sets existed): kept.
    redis.hincrby(prefix + "children", "q/1", 1)
    assert evict(["q/0"])[2] == ["PARENT"]
    redis.hdel(prefix + "children", "q/1")
    # Asked for 2 MiB, q/0 goes with q/1: the chain is gone, and so is its parent's count.
    assert evict(["q/0"], wanted=2 * MiB) == (MiB, 2, ["OK"])
    assert not any(client.exists(k) for k in tail)
    assert redis.hget(prefix + "children", "q/0") is None and not redis.exists(prefix + "kids:q/0")
    # A set of the right size naming a chunk not stored under that parent (an older writer counted
    # r/2 without naming it, an older evicter took a gone r/x from the count only): kept, or r/2
    # would have stayed, stored and readable, with its parent gone.
    drifted = [f"r/{i}" for i in range(3)]
    put_alternating_chain(client, drifted, nodes)
    redis.srem(prefix + "kids:r/1", "r/2")
    redis.sadd(prefix + "kids:r/1", "r/x")
    assert evict(["r/0"]) == (0, 0, ["PARENT"])
    assert all(client.exists(k) for k in drifted)
    redis.srem(prefix + "kids:r/1", "r/x")
    redis.sadd(prefix + "kids:r/1", "r/2")
    assert not settled_audit(client.index)


def idle(agent: Agent) -> None:
    """No pressure pass of its own: the test runs them, in the order PressureManager.run does."""
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


def test_chunks_whose_later_chunks_are_on_the_nodes_own_disk_are_demoted_not_evicted_with_them(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """One node: three 4-chunk chains, the first two chunks of each in host memory, the last two
    demoted to the node's disk, which is full; a read filler takes the host past its high
    watermark. The host pass can demote nothing until the disk pass (after it in a wake) evicts
    the disk's leaves. Its fallback evicted heads with their disk tails instead: 6 chunks lost
    where the next passes lose 2 and keep the rest (the heads demoted into the room made)."""
    agent = make_inproc_agent(host_bytes=8 * MiB, disk_path=str(tmp_path), disk_bytes=int(6.3 * MiB), prepare=idle)
    client = connect(agent.index.url, namespace=agent.namespace, lease_ms=60_000)
    rng = np.random.default_rng(0)  # incompressible: each chunk takes its 1 MiB on disk too
    chains = [[f"{name}/{i}" for i in range(4)] for name in "abc"]
    try:
        for keys in chains:
            client.put_many(
                {k: rng.integers(0, 256, MiB, dtype=np.uint8) for k in keys},
                chain_pos={k: i for i, k in enumerate(keys)},
                chain_parent={k: keys[i - 1] for i, k in enumerate(keys) if i},
            )
            victims = {v.key: v for v in agent.index.victim_candidates(agent.node_id, "host")}
            for key in (keys[3], keys[2]):  # tails first, as a pass demotes them
                location = agent.table.offset_of(victims[key].alloc_id)
                assert location is not None and agent.pressure.moves.demote_to_disk(victims[key], location[0])
            agent.reclaim_now(force=True)
        client.put("hot", np.zeros(3 * MiB // 2, np.uint8))
        client.get("hot")  # read under a 60 s lease: it stays
        agent.reclaim_now(force=True)
        everything = [k for keys in chains for k in keys]
        assert agent.pressure.relieve_host() == 0
        assert all(client.exists(k) for k in everything), "heads evicted with their tails on this node's disk"
        assert agent.pressure.relieve_disk() > 0
        agent.reclaim_now(force=True)
        assert agent.pressure.relieve_host() > 0
        present = [[client.exists(k) for k in keys] for keys in chains]
        assert all(p == sorted(p, reverse=True) for p in present), f"a chain lost its middle: {present}"
        assert sum(p.count(False) for p in present) == 2, present

        def tier_of(key: str) -> str | None:
            meta = client.object_meta(key)
            return str(meta.replicas[0].tier) if meta is not None else None

        # The disk is full again (the heads demoted into it): a head whose tails are there is left
        # to the disk's pass; with the disk not under pressure (no pass of its own to come), it
        # goes with them.
        keys = next(keys for keys in chains if [tier_of(k) for k in keys] == ["host", "host", "disk", "disk"])
        head, later = keys[1], keys[2:]
        meta = client.object_meta(head)
        assert meta is not None
        candidate = [(head, meta.replicas[0].alloc_id)]
        evict = functools.partial(
            agent.index.evict_chains, node_id=agent.node_id, tier="host", wanted_bytes=1, most_later=64
        )
        assert evict(candidate, pressed_tiers=["disk"])[:3] == (0, 0, ["LOCAL"])
        assert evict(candidate, pressed_tiers=[])[:3] == (MiB, 1 + len(later), ["OK"])
        assert not any(client.exists(k) for k in [head, *later])
        assert not settled_audit(client.index)
    finally:
        client.close()


def test_the_disk_pass_evicts_chains_by_the_blocks_their_files_free(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A disk pass's need is in the blocks its files take, but evict_chains.lua adds up the chunks'
    plain sizes, which it was given that need to reach: with compressible chunks (1 MiB of one
    byte, one 4 KiB block on disk) a need of two files' blocks stopped after the first chain,
    its 1 MiB past the 8 KiB wanted. The need now goes to the script in plain bytes, by the disk's
    own ratio of plain bytes to blocks."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    peers = {"heartbeat_interval_s": 600.0, "heartbeat_ttl_s": 1200.0, "host_bytes": 8 * MiB, "prepare": idle}
    here = make_inproc_agent(namespace=namespace, disk_path=str(tmp_path), disk_bytes=64 * MiB, **peers)
    there = make_inproc_agent(namespace=namespace, **peers)
    client = connect(here.index.url, namespace=namespace)
    chains = [[f"{name}/{i}" for i in range(2)] for name in "pq"]
    try:
        for keys in chains:
            put_alternating_chain(client, keys, [here.node_id, there.node_id])
        victims = {v.key: v for v in here.index.victim_candidates(here.node_id, "host")}
        for keys in chains:  # each head to this node's disk; its later chunk is on the other node
            location = here.table.offset_of(victims[keys[0]].alloc_id)
            assert location is not None and here.pressure.moves.demote_to_disk(victims[keys[0]], location[0])
        here.reclaim_now(force=True)
        disk = here.disk
        assert disk is not None and disk.objects == 2 and disk.used_bytes < MiB // 8
        candidates = here.index.victim_candidates(here.node_id, "disk")
        assert sorted(c.key for c in candidates) == ["p/0", "q/0"]
        need = disk.used_bytes  # both files' blocks
        assert here.pressure.evictions.evict_chains(candidates, TierKind.DISK, need) > 0
        gone = [k for keys in chains for k in keys if not client.exists(k)]
        assert gone == [k for keys in chains for k in keys], f"only {gone} went for a need of both files"
        assert not settled_audit(client.index)
    finally:
        client.close()


def test_a_disk_pass_counts_the_room_its_chain_cuts_made_in_blocks(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A disk pass whose evictions include a chain chunk sends them all through evict_chains.lua,
    which counts plain sizes; converted by the disk's average ratio, a compressible chain (64 KiB
    chunks of zeros, one 4 KiB block each) cut back among incompressible objects was counted at
    ~140 KiB where 12 KiB of blocks went, and the pass ended with a fifth of its need made (review).
    The room made is now what the files that went take."""
    agent = make_inproc_agent(disk_path=str(tmp_path), disk_bytes=8 * MiB, host_bytes=4 * MiB, prepare=idle)
    client = connect(agent.index.url, namespace=agent.namespace, lease_ms=20)
    size = 64 << 10
    chain = [f"A/{i}" for i in range(8)]
    others = [f"Q/{i}" for i in range(16)]
    rng = np.random.default_rng(0)
    try:
        for i, key in enumerate(chain):
            client.put_many(
                {key: np.zeros(size, np.uint8)}, chain_pos={key: i}, chain_parent={key: chain[i - 1]} if i else None
            )
        for key in others:
            client.put(key, rng.integers(0, 255, size, dtype=np.uint8))
        time.sleep(0.05)  # read leases over
        pressure = agent.pressure
        now = agent.index.server_time_ms()
        assert pressure._walk(TierKind.HOST, 64 * size, pressure._host_job, now_ms=now) > 0  # all to disk
        disk = agent.disk
        assert disk is not None and disk.objects == len(chain) + len(others)
        redis, prefix = client.index.redis, client.index.prefix
        for i, key in enumerate(chain):  # the chain coldest, the others warmer
            redis.hset(prefix + "o:" + key, "last_access", now - 100_000 + i)
        for i, key in enumerate(others):
            redis.hset(prefix + "o:" + key, "last_access", now - 50_000 + i)
        time.sleep(0.05)
        used, need = disk.used_bytes, 64 << 10
        moved = pressure._walk(TierKind.DISK, need, pressure._disk_job, now_ms=agent.index.server_time_ms())
        agent.reclaim_now(force=True)
        freed = used - disk.used_bytes
        assert moved == freed, f"counted {moved} B of room, {freed} B went"
        assert freed >= need
        present = [client.exists(k) for k in chain]
        assert present == sorted(present, reverse=True), present  # cut back from its leaves
        assert not settled_audit(client.index)
    finally:
        client.close()
