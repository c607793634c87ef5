"""Index, left from the session-29 Lua review: a malformed object record failed a whole read batch
and a put_many with cjson's words, naming no key; a stats counter that is no integer failed every
counted get (lookup's HINCRBY) and every eviction that counted a loss, after the eviction's first
writes; a chain parent's child count that is no integer failed the eviction of its child after
that eviction's writes, and cut the pressure sample's reply short at its nil."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

import numpy as np
import pytest
from helpers import stop_process

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
    # The agent stopped, so that its sync (every 0.2 s) cannot take the due grave before it is seen.
    agent_pid = cluster.agents[0].pid
    stop_process(agent_pid)
    try:
        assert index.evict_many([("cold", alloc)], node_id=node) == ["OK"]  # its last replica: a loss counted
        assert not client.exists("cold") and not index.redis.exists(index.prefix + "o:cold")
        assert index.redis.zscore(index.prefix + "gc:" + node, str(alloc)) is not None  # its memory is freed
    finally:
        os.kill(agent_pid, signal.SIGCONT)
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


def test_a_lease_that_is_no_number_leaves_its_record_alone_and_fails_nothing_else(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A remove deleted the record, then failed before its replica reached the graveyard (its
    memory never freed); a put_commit and an eviction failed after the batch's earlier writes; the
    pressure sample raised ValueError on it (diff review)."""
    cluster = make_cluster(1)
    client = make_client(cluster)
    index, node = client.index, cluster.agents[0].node_id
    client.put_many({"l1": b"1", "bad": b"2", "l3": b"3"})
    allocs = {key: index.replicas_listed(key)[0].alloc_id for key in ("l1", "bad")}  # type: ignore[index]
    index.redis.hset(index.prefix + "o:bad", "lease_until", "abc")
    record = index.redis.hgetall(index.prefix + "o:bad")
    with pytest.raises(ProtocolError, match=r"\['o:bad'\]; stored the other 2 key\(s\)"):
        client.put_many({"n1": b"n", "bad": b"x", "n3": b"z"})
    assert index.evict_many([("l1", allocs["l1"]), ("bad", allocs["bad"])], node_id=node) == ["OK", "MALFORMED"]
    assert "bad" not in {c.key for c in index.victim_candidates(node, "host")}
    with pytest.raises(ProtocolError, match=r"\['bad'\].*removed the other 1"):
        client.remove_many(["l3", "bad"])
    assert index.redis.hgetall(index.prefix + "o:bad") == record  # untouched by all of it
    assert client.exists("n1") and client.exists("n3") and not client.exists("l1") and not client.exists("l3")


@pytest.mark.parametrize("malformed", ["shape", "size"])
def test_a_malformed_later_chunk_keeps_its_chain_and_fails_no_other_candidate(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], malformed: str
) -> None:
    """evict_chains failed on it after the candidates before it were evicted: their ids were
    lost to the agent, and every later pass that sampled the chain failed again (diff review)."""
    cluster = make_cluster(1)
    client = make_client(cluster)
    index, node = client.index, cluster.agents[0].node_id
    client.put_many({"A0": b"a0", "B0": b"b0"}, chain_pos={"A0": 0, "B0": 0})
    client.put_many({"A1": b"a1", "B1": b"b1"}, chain_pos={"A1": 1, "B1": 1}, chain_parent={"A1": "A0", "B1": "B0"})
    allocs = {key: index.replicas_listed(key)[0].alloc_id for key in ("A0", "B0")}  # type: ignore[index]
    if malformed == "shape":
        index.redis.hset(index.prefix + "o:B1", "replicas", f'[["{node}"]]')  # JSON, not this build's shape
    else:  # a size that is no number: the arithmetic on it failed the script (second diff review)
        replicas = json.loads(index.redis.hget(index.prefix + "o:B1", "replicas"))
        replicas[0][3] = "big"
        index.redis.hset(index.prefix + "o:B1", "replicas", json.dumps(replicas))
    freed, evicted, statuses, gone = index.evict_chains(
        [("A0", allocs["A0"]), ("B0", allocs["B0"])], node_id=node, tier="host", wanted_bytes=1 << 30, most_later=64
    )
    assert (freed, evicted, statuses) == (4, 2, ["OK", "MALFORMED"]) and allocs["A0"] in gone
    assert not client.exists("A0") and not client.exists("A1") and client.exists("B0")
