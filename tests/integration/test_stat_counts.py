"""What stat() counts: one hit or miss per key and get however many lookups its retries take, one
agent read per object however many stripes its transfer took, and damaged replicas."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import Client, ConnectError, LocalCluster, MooncakeError, connect
from mooncake_store.agent.node import Agent
from mooncake_store.client.prefix import PrefixCache
from mooncake_store.client.stats import ClusterStats, TierStats
from mooncake_store.types import ALLOC_TAG_SHIFT, Replica, ReplicaState, TierKind

MiB = 1 << 20


def tier_of(stats: ClusterStats, node_id: str, tier: str) -> TierStats:
    (node,) = [n for n in stats.nodes if n.node_id == node_id]
    (found,) = [t for t in node.tiers if t.tier == tier]
    return found


def test_a_get_that_retries_counts_one_hit(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Each attempt of a get looked the key up again, and each lookup counted a hit: a get of a key
    whose agent had just died (a TransferError after all its retries) showed as 4 hits."""
    cluster = make_cluster(2, host_bytes=8 * MiB, heartbeat_ttl_s=20)
    client = make_client(cluster, transports=("tcp",), max_retries=3)
    client.put("a", np.zeros(1000, np.uint8), preferred_node="agent-1")
    cluster.agent("agent-1").kill()
    with pytest.raises(MooncakeError):
        client.get("a")
    stats = client.stat()
    assert (stats.hits, stats.misses) == (1, 0)
    assert tier_of(stats, "agent-1", "host").hits == 1
    with pytest.raises(MooncakeError):
        client.get("nothing-here")
    assert (client.stat().hits, client.stat().misses) == (1, 1)


def test_a_striped_read_counts_one_agent_read(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A 16 MiB object over TCP is four READs of 4 MiB stripes: it counted four reads."""
    cluster = make_cluster(1, host_bytes=64 * MiB)
    client = make_client(cluster, transports=("tcp",), stripe_bytes=4 * MiB)
    node = cluster.agents[0].node_id
    client.put("big", np.zeros(16 * MiB, np.uint8))
    client.put("small", np.zeros(1000, np.uint8))
    client.get("big")
    assert wait_until(lambda: tier_of(client.stat(), node, "host").reads == 1, 5)
    client.get("small")
    assert wait_until(lambda: tier_of(client.stat(), node, "host").reads == 2, 5)
    assert tier_of(client.stat(), node, "host").reads == 2


def test_a_damaged_chunk_file_is_counted_in_stat(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    """The agent counted a chunk file that failed its checksum, and the index the object lost, but
    neither stat() nor `mooncake stat --json` showed either."""
    cluster = make_cluster(1, host_bytes=8 * MiB, agent_args=["--disk", str(tmp_path), "--disk-mem", "64MiB"])
    client = make_client(cluster)
    rng = np.random.default_rng(0)
    keys = [f"k{i}" for i in range(10)]
    for key in keys:
        client.put(key, rng.integers(0, 4, size=MiB, dtype=np.uint8))
    node = cluster.agents[0].node_id

    def on_disk() -> list[str]:
        metas = [(key, client.object_meta(key)) for key in keys]
        return [key for key, meta in metas if meta and any(str(r.tier) == "disk" for r in meta.replicas)]

    assert wait_until(lambda: bool(on_disk()), 10)
    victim = on_disk()[0]
    for path in tmp_path.rglob("*.mcz"):
        with path.open("r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(MooncakeError):
        client.get(victim)
    assert wait_until(lambda: tier_of(client.stat(), node, "disk").corrupt >= 1, 5)
    stats = client.stat()
    assert stats.corrupt == 1 and stats.as_dict()["corrupt"] == 1


def test_a_prefix_load_whose_batch_read_fails_counts_each_chunk_once(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A load whose batch read fails (a chunk's node died after the match) reads its chunks again
    one by one to keep the readable run; each of those gets counted its key again, after the
    batch's lookup had: two chunks showed four hits."""
    cluster = make_cluster(2, host_bytes=8 * MiB, heartbeat_ttl_s=20)
    client = make_client(cluster, transports=("tcp",), max_retries=1)
    cache = PrefixCache(client, "stat-prefix/f32/L1/kv1/d8/tp0", chunk_tokens=4)
    tokens = np.arange(8, dtype=np.int64)
    chunks = [np.full(64, i, np.float32) for i in range(2)]
    cache.store(tokens[:4], chunks[:1], preferred_node="agent-0")
    cache.store(tokens, chunks, preferred_node="agent-1")  # the second chunk only, on agent-1
    placed = [client.object_meta(k) for k in cache.keys(tokens)]
    assert [m.replicas[0].node_id for m in placed if m] == ["agent-0", "agent-1"]
    cluster.agent("agent-1").kill()
    with cache.load(tokens) as hit:
        assert hit.num_chunks == 1
        assert hit.chunks[0].tolist() == chunks[0].tolist()
    stats = client.stat()
    assert (stats.hits, stats.misses) == (2, 0)
    assert tier_of(stats, "agent-0", "host").hits == 1
    cache.close()


def test_the_cli_get_that_looks_again_counts_one_hit(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """`mooncake get` sizes its buffer by the object's metadata, then reads; an object replaced by
    a larger one in between is read again, and that second read counted a second hit."""
    from mooncake_cli.commands.data import _fetch

    cluster = make_cluster(1, host_bytes=8 * MiB)
    client = make_client(cluster)
    writer = make_client(cluster)
    client.put("grows", np.zeros(1000, np.uint8))
    real_meta = client.object_meta
    replaced: list[bool] = []

    def meta_then_replace(key: str) -> object:
        meta = real_meta(key)
        if not replaced:  # the object grows between the size lookup and the read, once
            writer.put(key, np.ones(3000, np.uint8))
            replaced.append(True)
        return meta

    client.object_meta = meta_then_replace  # type: ignore[method-assign]
    assert _fetch(client, "grows").tolist() == [1] * 3000
    assert replaced
    assert (client.stat().hits, client.stat().misses) == (1, 0)


def test_an_object_lost_then_dropped_by_a_late_holder_counts_one_eviction(
    make_inproc_agent: Callable[..., Agent], redis_url: str
) -> None:
    """An object with two copies: one node is past its heartbeat deadline (not reaped yet) when
    the other's copy is evicted, so the object is lost to readers (one eviction). The late node
    then beats again and its copy is evicted too: the same object counted a second eviction."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    quiet = {"heartbeat_interval_s": 3000.0, "heartbeat_ttl_s": 3600.0, "host_bytes": 8 * MiB}
    first = make_inproc_agent(namespace=namespace, node_id="late-a", **quiet)
    second = make_inproc_agent(namespace=namespace, node_id="late-b", **quiet)
    client = connect(redis_url, namespace=namespace)
    try:
        client.put("twice", np.full(1000, 3, np.uint8), replicas=2)
        meta = client.object_meta("twice")
        assert meta is not None and sorted(r.node_id for r in meta.replicas) == ["late-a", "late-b"]
        by_node = {r.node_id: r for r in meta.replicas}
        index = client.index
        deadline = index.redis.zscore(index.prefix + "hb", second.node_id)
        index.redis.zadd(index.prefix + "hb", {second.node_id: 1})  # past its deadline, not reaped
        assert index.evict("twice", node_id=first.node_id, alloc_id=by_node[first.node_id].alloc_id) == "OK"
        assert client.stat().evictions == 1  # no readable copy left
        index.redis.zadd(index.prefix + "hb", {second.node_id: deadline})  # it beats again
        (back,) = index.lookup(["twice"], lease_ms=0, counted=False).objects  # readable again (no read lease)
        assert back is not None and [r.node_id for r in back.replicas] == [second.node_id]
        assert index.evict("twice", node_id=second.node_id, alloc_id=by_node[second.node_id].alloc_id) == "OK"
        assert not client.exists("twice")
        assert client.stat().evictions == 1
        # The mark is the object's: one stored over a lost one (whose copy on the late node is
        # still named) and then evicted is a loss of its own.
        client.put("twice", np.full(1000, 4, np.uint8), replicas=2)
        index.redis.zadd(index.prefix + "hb", {second.node_id: 1})
        (meta,) = index.lookup(["twice"], lease_ms=0, counted=False).objects
        assert meta is not None
        (on_first,) = [r for r in meta.replicas if r.node_id == first.node_id]
        assert index.evict("twice", node_id=first.node_id, alloc_id=on_first.alloc_id) == "OK"
        assert client.stat().evictions == 2
        index.redis.zadd(index.prefix + "hb", {second.node_id: deadline})
        client.put("twice", np.full(1000, 5, np.uint8), preferred_node=first.node_id)
        (again,) = index.lookup(["twice"], lease_ms=0, counted=False).objects
        assert again is not None and [r.node_id for r in again.replicas] == [first.node_id]
        assert index.evict("twice", node_id=first.node_id, alloc_id=again.replicas[0].alloc_id) == "OK"
        assert client.stat().evictions == 3
    finally:
        client.close()


def test_a_copy_made_after_a_loss_is_counted_when_it_is_lost(
    make_inproc_agent: Callable[..., Agent], redis_url: str
) -> None:
    """The mark that keeps a loss from being counted twice names the copies left at that loss: a
    copy made since (re-replication from the late node, once back) and then lost is a new loss,
    and so is damage found after it. The first version marked the object as a whole, and this
    object's second loss went uncounted."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    quiet = {"heartbeat_interval_s": 3000.0, "heartbeat_ttl_s": 3600.0, "host_bytes": 8 * MiB}
    first, second, third = (make_inproc_agent(namespace=namespace, node_id=f"copy-{n}", **quiet) for n in "abc")
    client = connect(redis_url, namespace=namespace)
    try:
        client.put("x", np.full(1000, 3, np.uint8), replicas=2, preferred_node=first.node_id)
        (meta,) = client.index.lookup(["x"], lease_ms=0, counted=False).objects
        assert meta is not None
        on = {r.node_id: r for r in meta.replicas}
        assert set(on) == {first.node_id, second.node_id}, on
        index = client.index
        deadline = index.redis.zscore(index.prefix + "hb", second.node_id)
        index.redis.zadd(index.prefix + "hb", {second.node_id: 1})  # past its deadline
        assert index.drop_corrupt("x", on[first.node_id].alloc_id, node_id=first.node_id)
        assert (client.stat().corrupt, client.stat().evictions) == (1, 0)
        index.redis.zadd(index.prefix + "hb", {second.node_id: deadline})  # back
        copy = Replica(
            node_id=third.node_id,
            tier=TierKind.HOST,
            offset=0,
            size_bytes=1000,
            alloc_id=(third.alloc_tag << ALLOC_TAG_SHIFT) + 999,
            state=ReplicaState.PENDING,
        )
        assert index.copy_replicas([("x", on[second.node_id].alloc_id, copy, "")], src_node=second.node_id) == ["OK"]
        assert index.evict("x", node_id=second.node_id, alloc_id=on[second.node_id].alloc_id) == "OK"
        assert client.stat().evictions == 0  # the copy on the third node is readable
        assert index.evict("x", node_id=third.node_id, alloc_id=copy.alloc_id) == "OK"
        assert not client.exists("x")
        assert (client.stat().corrupt, client.stat().evictions) == (1, 1)
    finally:
        client.close()


def test_a_prefix_load_whose_batch_lookup_failed_counts_its_chunks_when_read_again(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The per-chunk reads after a failed batch read count nothing again only if the batch's
    lookup counted the keys: one that failed on its way to the index (here its first call raises
    ConnectError, as a dropped connection does) counted nothing, and the chunks then read one by
    one count their hits."""
    cluster = make_cluster(1, host_bytes=8 * MiB)
    client = make_client(cluster)
    cache = PrefixCache(client, "stat-prefix-blip/f32/L1/kv1/d8/tp0", chunk_tokens=4)
    tokens = np.arange(8, dtype=np.int64)
    cache.store(tokens, [np.full(64, i, np.float32) for i in range(2)])
    real_lookup = client.index.lookup
    calls: list[int] = []

    def blip_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectError("the index connection dropped (test)")
        return real_lookup(*args, **kwargs)

    client.index.lookup = blip_once  # type: ignore[method-assign]
    with cache.load(tokens) as hit:
        assert hit.num_chunks == 2
    assert len(calls) == 3  # the batch's, then one per chunk
    assert (client.stat().hits, client.stat().misses) == (2, 0)
    cache.close()
