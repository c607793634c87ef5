"""Index review (session 29): what one malformed key or an index that restarted empty did.
put_commit buried the old replicas and acked the new allocations before an INCR that could fail
(the record then named freed memory: reads of another object's bytes once it was reused); one
malformed node row failed every client's calls in the namespace; `created` or a counter that is
no integer reached `mooncake ls` and stat() as a bare ValueError; a put just after the index
restarted empty failed at once ("no live agent is registered") where the README says it waits."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import Client, LocalCluster, MooncakeError, NoCapacity
from mooncake_store.errors import ProtocolError

MiB = 1 << 20


def _graves(client: Client, node_id: str) -> list[str]:
    return client.index.redis.zrange(client.index.prefix + "gc:" + node_id, 0, -1)


def test_a_commit_that_fails_on_a_bad_counter_writes_nothing(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1, host_bytes=8 * MiB)
    client = make_client(cluster)
    first = np.full(MiB // 4, 1, np.float32)
    client.put("r", first)
    record = client.index.redis.hgetall(client.index.prefix + "o:r")
    version_key = client.index.prefix + "version"
    version = client.index.redis.get(version_key)
    client.index.redis.set(version_key, "abc")  # a counter written over by hand
    try:
        with pytest.raises(MooncakeError, match="put_commit"):
            client.put("r", np.full(MiB // 4, 2, np.float32))
        assert client.index.redis.hgetall(client.index.prefix + "o:r") == record  # not buried, not replaced
        assert _graves(client, cluster.agents[0].node_id) == []
    finally:
        client.index.redis.set(version_key, version or "0")
    assert np.array_equal(client.get("r"), first)
    for i in range(6):  # the arena's memory is reused: the record's replica must still be its own
        client.put(f"fill{i}", np.full(MiB // 4, 7, np.float32))
    assert np.array_equal(client.get("r"), first)


def test_a_malformed_node_row_is_left_out_and_named_once(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    client.index.redis.hset(client.index.prefix + "nodes", "ghost", "garbage{")
    client.put("k", b"value")
    assert client.get("k").tobytes() == b"value"
    assert [n.node_id for n in client.stat().nodes] == [cluster.agents[0].node_id]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "'ghost' left out" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(("key", "field"), [("o:k", "created"), ("stats", "hits")])
def test_an_index_field_that_is_no_integer_is_a_protocol_error_naming_it(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], key: str, field: str
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    client.put("k", b"value")
    client.index.redis.hset(client.index.prefix + key, field, "abc")
    with pytest.raises(ProtocolError, match=f"{key.replace('stats', 'stats ')}.*{field}.*'abc' is no integer"):
        if key == "stats":
            client.stat()
        else:
            client.index.list_keys()


def test_a_put_just_after_the_index_restarted_empty_waits_for_the_agents(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2)
    client = make_client(cluster, timeout_s=20.0)
    client.put("before", b"x")
    redis = client.index.redis
    # The namespace's keys gone at once, as after a restart of its server with nothing persisted.
    keys = list(redis.scan_iter(client.index.prefix + "*", count=1000))
    redis.delete(*keys)
    client._node_table(refresh=True)  # the client sees the empty table
    client.put("after", b"y")  # waits for the agents' next heartbeats (about a second)
    assert client.get("after").tobytes() == b"y"


def test_a_malformed_replica_list_is_named_as_such_and_a_remove_of_it_buries_nothing(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster)
    client.put("bad", b"value")
    client.index.redis.hset(client.index.prefix + "o:bad", "replicas", "[[garbage")
    with pytest.raises(ProtocolError, match=r"malformed replica list in the index record o:bad: \[\[garbage"):
        client.get("bad")
    with pytest.raises(ProtocolError, match=r"\['bad'\]: their index records are malformed"):
        client.remove("bad")
    assert client.index.redis.hget(client.index.prefix + "o:bad", "replicas") == "[[garbage"
    assert _graves(client, cluster.agents[0].node_id) == []


MALFORMED_LISTS = {
    "a number among the replicas": '[["{node}", "host", 0, 5, "1", "COMPLETE"], 5]',
    "a null tier": '[["{node}", null, 0, 5, "1", "COMPLETE"]]',
    "a null alloc id": '[["{node}", "host", 0, 5, null, "COMPLETE"]]',
}


@pytest.mark.parametrize("malformed", list(MALFORMED_LISTS))
def test_a_malformed_record_is_passed_over_by_a_pressure_sample_and_a_dead_nodes_purge(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], malformed: str
) -> None:
    """With one record's replica list of the wrong shape, every pressure pass of its node failed
    ("victims failed"), and its node, once dead, was never reaped (every node_reap call failed,
    holding up the other dead nodes of the call too)."""
    cluster = make_cluster(1, heartbeat_ttl_s=2.0)
    client = make_client(cluster)
    node = cluster.agents[0].node_id
    for key in ("good", "bad"):
        client.put(key, b"value")
    index = client.index
    good_replicas = index.redis.hget(index.prefix + "o:good", "replicas")
    index.redis.hset(index.prefix + "o:bad", "replicas", MALFORMED_LISTS[malformed].replace("{node}", node))
    sampled = {c.key for c in index.victim_candidates(node, "host")}
    assert sampled == {"good"}, sampled
    cluster.agents[0].kill()
    assert wait_until(lambda: node in index.reap_dead_nodes(grace_ms=0), 30)
    assert node not in index.nodes()
    assert not index.redis.exists(index.prefix + "nobj:" + node)
    assert index.redis.hget(index.prefix + "o:good", "replicas") != good_replicas  # its replica left with its node


def test_a_commit_onto_a_malformed_record_or_count_fails_having_written_nothing(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Two steps could still fail after the first write: the old replica list (decoded, but of
    the wrong shape) and the chain parent's child count (a put then raised with its object
    stored, acked and readable, but not listed). Second diff review."""
    cluster = make_cluster(1)
    client = make_client(cluster)
    index, node = client.index, cluster.agents[0].node_id
    client.put("old", b"first")
    index.redis.hset(index.prefix + "o:old", "replicas", '[["' + node + '", "host", 0, 5, "1", "COMPLETE"], 5]')
    version = index.redis.get(index.prefix + "version")
    with pytest.raises(ProtocolError, match=r"index records are malformed.*\['o:old'\]"):
        client.put("old", b"second")
    assert index.redis.get(index.prefix + "version") == version and _graves(client, node) == []
    client.put_many({"a": b"parent"}, chain_pos={"a": 0})
    index.redis.hset(index.prefix + "children", "a", "abc")
    with pytest.raises(ProtocolError, match=r"index records are malformed.*the chain parent child count for 'b'"):
        client.put_many({"b": b"child"}, chain_pos={"b": 1}, chain_parent={"b": "a"})
    assert not index.redis.exists(index.prefix + "o:b")
    assert not index.redis.sismember(index.prefix + "kids:a", "b")


def test_a_remove_leaves_a_malformed_record_untouched_and_removes_the_rest(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """It deleted the record and buried a replica, then failed on the list's shape (second diff review)."""
    cluster = make_cluster(1)
    client = make_client(cluster)
    index, node = client.index, cluster.agents[0].node_id
    client.put_many({"good": b"g", "bad": b"b"})
    bad_list = '[["' + node + '", "host", 0, 5, "1", "COMPLETE"], 5]'
    index.redis.hset(index.prefix + "o:bad", "replicas", bad_list)
    with pytest.raises(ProtocolError, match=r"\['bad'\]: their index records are malformed.*removed the other 1"):
        client.remove_many(["good", "bad"])
    assert index.redis.hget(index.prefix + "o:bad", "replicas") == bad_list
    assert not index.redis.exists(index.prefix + "o:good")
    assert len(_graves(client, node)) == 1  # good's replica alone


def test_a_put_after_every_agent_was_stopped_fails_at_once(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Agents stopped on purpose leave their last heartbeat recorded: no restart is under way,
    and the put fails as before instead of waiting timeout_s for nodes that will not come
    (second diff review of the restart wait)."""
    cluster = make_cluster(1)
    client = make_client(cluster, timeout_s=30.0)
    client.put("before", b"x")
    cluster.agents[0].stop()
    client._node_table(refresh=True)
    with pytest.raises(NoCapacity) as caught:
        client.put("after", b"y")
    assert "no live agent is registered" in str(caught.value) and "waited" not in str(caught.value)
