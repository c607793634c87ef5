"""Index, left from the session-29 Lua review: a malformed object record failed a whole read batch
and a put_many with cjson's words, naming no key; a stats counter that is no integer failed every
counted get (lookup's HINCRBY) and every eviction that counted a loss, after the eviction's first
writes; a chain parent's child count that is no integer failed the eviction of its child after
that eviction's writes, and cut the pressure sample's reply short at its nil."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster
from mooncake_store.errors import ProtocolError

MiB = 1 << 20
GARBAGE = "[[garbage"


def test_a_malformed_record_is_a_protocol_error_naming_its_key(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    client.put_many({"good": b"g", "bad": b"b"})
    client.index.redis.hset(client.index.prefix + "o:bad", "replicas", GARBAGE)
    named = r"malformed replica list in the index record o:bad: \[\[garbage \(namespace"
    with pytest.raises(ProtocolError, match=named):
        client.get_many(["good", "bad"])
    with pytest.raises(ProtocolError, match=named):
        client.exists("bad")
    # A put is refused key by key, as a pinned key's is: the batch's other keys are stored.
    with pytest.raises(ProtocolError, match=r"malformed.*\['o:bad'\]; stored the other 2 key\(s\): \['new', 'after'\]"):
        client.put_many({"new": b"n", "bad": b"x", "after": b"a"})
    assert [v.tobytes() for v in client.get_many(["good", "new", "after"])] == [b"g", b"n", b"a"]
    assert client.index.redis.hget(client.index.prefix + "o:bad", "replicas") == GARBAGE


def test_a_stats_counter_that_is_no_integer_fails_no_read_and_no_eviction(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    index, node = client.index, cluster.agents[0].node_id
    client.put_many({"a": b"aa", "b": b"bb", "cold": b"cc"})
    for field in ("hits", "misses", f"hits:{node}:host", "evictions"):
        index.redis.hset(index.prefix + "stats", field, "abc")
    assert client.get("a").tobytes() == b"aa"
    assert client.get_many(["b", "missing"])[0].tobytes() == b"bb"
    alloc = index.replicas_listed("cold")[0].alloc_id  # type: ignore[index]
    assert index.evict_many([("cold", alloc)], node_id=node) == ["OK"]  # its last replica: a loss counted
    assert not client.exists("cold") and not index.redis.exists(index.prefix + "o:cold")
    assert index.redis.zscore(index.prefix + "gc:" + node, str(alloc)) is not None  # its memory is freed
    with pytest.raises(ProtocolError, match=r"stats.*'abc' is no integer"):
        client.stat()  # where the hand edit shows


def test_a_child_count_that_is_no_integer_fails_no_eviction_and_keeps_the_parent(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1, host_bytes=16 * MiB)
    client = make_client(cluster)
    index, node = client.index, cluster.agents[0].node_id
    chunk = np.ones(MiB // 4, np.float32)
    client.put_many({"p": chunk}, chain_pos={"p": 0})
    client.put_many({"c": chunk}, chain_pos={"c": 1}, chain_parent={"c": "p"})
    client.put("plain", chunk)
    index.redis.hset(index.prefix + "children", "p", "abc")
    sample = {c.key: c for c in index.victim_candidates(node, "host")}
    assert set(sample) == {"p", "c", "plain"}  # the reply is whole past the bad count
    assert sample["p"].children == 1 and sample["plain"].children == 0
    p_alloc, c_alloc = sample["p"].alloc_id, sample["c"].alloc_id
    assert index.evict_many([("p", p_alloc)], node_id=node) == ["PARENT"]  # kept: it may have children
    assert index.evict_many([("c", c_alloc)], node_id=node) == ["OK"]
    assert not client.exists("c") and np.array_equal(client.get("p"), chunk)
    assert not index.redis.sismember(index.prefix + "kids:p", "c")
    assert index.redis.hget(index.prefix + "children", "p") == "abc"  # left for put and remove to name
