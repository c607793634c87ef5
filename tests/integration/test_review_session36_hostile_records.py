"""Index records not of this build's making (written by hand, by another build, or damaged), as
their readers meet them (review, thirty-sixth session). README: such a record is a ProtocolError
naming it where it is read, one bad record fails only what touches it, and pressure passes,
syncs, repairs and purges pass over it and leave it as it is. Each case here broke that:

- a number Lua's tonumber takes and int() does not ("1.5", "1e999", "0x1") in a sampled victim
  failed every pressure pass of its node with a ValueError;
- an ack or a grave that is no integer failed the node's sync, and every later one (the reply was
  never applied, so it came again): graves were never freed;
- a grave that is no integer failed every pressure pass;
- a heartbeat deadline of +-inf, or a node row of bytes that are no UTF-8, failed every new
  client, stat() and agent start in the namespace (OverflowError, UnicodeDecodeError);
- bytes that are no UTF-8 in an object record escaped get, exists and list_keys as a
  UnicodeDecodeError;
- one malformed record in a holder's repair list (a replica list, or a tier this build does not
  know) failed every repair call, and the other short objects stayed short;
- an object record of another Redis type (a string where the hash is) failed a remove or a put
  batch half-way with a WRONGTYPE naming no key, and a purge of its node at every try."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.agent.node import Agent
from mooncake_store.errors import MooncakeError, ProtocolError

MiB = 1 << 20


@pytest.mark.parametrize(
    ("field", "value"), [("size", "1.5"), ("last_access", "1.5"), ("lease_until", "1e999"), ("chain_pos", "0x1")]
)
def test_a_victim_number_lua_takes_fails_no_pressure_pass(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, field: str, value: str
) -> None:
    agent = direct_agent(namespace, host_bytes=4 * MiB, high_watermark=0.5, low_watermark=0.3)
    client = client_of(namespace)
    for i in range(12):  # 3 MiB of 4: past the high watermark
        client.put(f"k{i}", np.ones(MiB // 4, np.uint8))
    client.index.redis.hset(client.index.prefix + "o:k0", field, value)
    sample = client.index.victim_candidates(agent.node_id, "host")
    assert "k0" not in {c.key for c in sample} and len(sample) == 11
    assert agent.pressure.relieve_host() > 0  # the others go; k0 is left as it is
    assert client.index.redis.hget(client.index.prefix + "o:k0", field) == value


# The no-UTF-8 entries (thirty-seventh session): the connection decoded the sync's reply, and
# its UnicodeDecodeError failed the sync, and every later one, as a ProtocolError.
@pytest.mark.parametrize("where", ["acks", "gc", "acks_no_utf8", "ack_key_no_utf8", "gc_no_utf8"])
def test_an_ack_or_grave_that_is_no_integer_stops_no_sync(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, where: str
) -> None:
    agent = direct_agent(namespace)
    client = client_of(namespace)
    r, p, node = client.index.redis, client.index.prefix, agent.node_id
    client.put("a", np.ones(1 << 16, np.uint8))
    agent.sync_once()
    assert len(agent.table.committed_ids()) == 1
    if where == "acks":
        r.rpush(p + "acks:" + node, "1.5")
    elif where == "acks_no_utf8":
        r.rpush(p + "acks:" + node, b"\xff\xfe")
    elif where == "ack_key_no_utf8":
        r.rpush(p + "acks:" + node, b"123456\t\xff")
    elif where == "gc_no_utf8":
        r.zadd(p + "gc:" + node, {b"\xff": 1})
    else:
        r.zadd(p + "gc:" + node, {"abc": 1})
    agent.sync_once()  # passed over, not raised
    client.remove("a")  # its grave is due at once (no lease was granted)
    agent.sync_once()
    assert len(agent.table.committed_ids()) == 0, "the removed object's memory was not freed"


def test_a_grave_that_is_no_integer_fails_no_pressure_pass(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    agent = direct_agent(namespace, host_bytes=4 * MiB, high_watermark=0.5, low_watermark=0.3)
    client = client_of(namespace)
    for i in range(12):
        client.put(f"k{i}", np.ones(MiB // 4, np.uint8))
    client.index.redis.zadd(client.index.prefix + "gc:" + agent.node_id, {"abc": 1})
    assert agent.pressure.relieve_host() > 0


@pytest.mark.parametrize("hostile", ["hb_inf", "hb_minus_inf", "row_bytes", "id_bytes"])
def test_one_hostile_node_entry_fails_no_other_client_or_agent(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, hostile: str
) -> None:
    direct_agent(namespace)
    first = client_of(namespace)
    first.put("a", b"aa")
    r, p = first.index.redis, first.index.prefix
    if hostile == "hb_inf":
        r.zadd(p + "hb", {"ghost": float("inf")})
    elif hostile == "hb_minus_inf":
        r.zadd(p + "hb", {"ghost": float("-inf")})
    elif hostile == "row_bytes":
        r.hset(p + "nodes", "ghost", b'{"node_id": "\xff"}')
    else:
        r.hset(p + "nodes", b"gh\xffost", r.hget(p + "nodes", next(iter(first.index.nodes()))))
    fresh = client_of(namespace)
    fresh.put("b", b"bb")
    assert fresh.get("a").tobytes() == b"aa"
    assert len(fresh.stat().nodes) == 1
    second = direct_agent(namespace)  # a new agent starts, and is in the table
    assert second.node_id in fresh._node_table(refresh=True)


def test_non_utf8_bytes_in_an_object_record_are_a_protocol_error(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    client = make_client(make_cluster(1), timeout_s=5.0)
    client.put_many({"good": b"g", "bad": b"b"})
    client.index.redis.hset(client.index.prefix + "o:bad", "dtype", b"\xff")
    for read in (lambda: client.get("bad"), lambda: client.exists("bad"), lambda: client.index.list_keys()):
        with pytest.raises(ProtocolError, match="no UTF-8"):
            read()
    assert client.get("good").tobytes() == b"g"  # the connection dropped on it is not needed again


@pytest.mark.parametrize("bad", ["garbage", "tier"])
def test_one_malformed_record_in_a_repair_list_stops_no_other_repair(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, bad: str
) -> None:
    a = direct_agent(namespace, spill_shm=False)
    b = direct_agent(namespace)
    client = client_of(namespace)
    values = {f"r{i}": np.full(512, i, np.uint8) for i in range(6)}
    client.put_many(values, replicas=2, preferred_node=a.node_id)  # every second copy on b
    direct_agent(namespace)  # where the copies go
    for agent in (a, b):
        agent.sync_once()
    r, p = a.index.redis, a.index.prefix
    r.zadd(p + "hb", {b.node_id: 1})
    assert b.node_id in a.index.reap_dead_nodes(grace_ms=0)
    assert r.scard(p + "repair:" + a.node_id) == 6
    if bad == "garbage":
        r.hset(p + "o:r0", "replicas", "[[garbage")
    else:  # well formed to the scripts, a tier this build does not know
        reps = json.loads(r.hget(p + "o:r0", "replicas"))
        reps[0][1] = "xpu"
        r.hset(p + "o:r0", "replicas", json.dumps(reps))
    for _ in range(3):
        a.pressure.repairs.run_once(set())
    whole = sorted(k for k in values if k != "r0" and len(client.object_meta(k).replicas) == 2)
    assert whole == [f"r{i}" for i in range(1, 6)]
    assert r.sismember(p + "repair:" + a.node_id, "r0")  # left as it is, still listed


def _wrong_type(client: Client, key: str) -> None:
    r, p = client.index.redis, client.index.prefix
    r.delete(p + "o:" + key)
    r.set(p + "o:" + key, "x")


def test_a_remove_batch_with_a_record_of_another_type_removes_the_rest_and_names_it(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    client = make_client(make_cluster(1), timeout_s=5.0)
    client.put_many({"w1": b"1", "w2": b"2", "w3": b"3"})
    _wrong_type(client, "w2")
    with pytest.raises(ProtocolError, match="w2"):
        client.remove_many(["w1", "w2", "w3"])
    assert not client.exists("w1") and not client.exists("w3")
    assert client.index.redis.get(client.index.prefix + "o:w2") == "x"  # left as it is


def test_a_put_batch_with_a_record_of_another_type_stores_the_rest(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    client = make_client(make_cluster(1), timeout_s=5.0)
    client.put("w2", b"2")
    _wrong_type(client, "w2")
    with pytest.raises(ProtocolError, match="w2"):
        client.put_many({"n1": b"1", "w2": b"2", "n3": b"3"})
    assert client.get("n1").tobytes() == b"1" and client.get("n3").tobytes() == b"3"


def test_a_record_of_another_type_fails_no_purge_of_its_node(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    a = direct_agent(namespace)
    b = direct_agent(namespace)
    client = client_of(namespace)
    client.put_many({"x1": b"1", "x2": b"2"}, preferred_node=b.node_id)
    _wrong_type(client, "x1")
    client.index.redis.zadd(client.index.prefix + "hb", {b.node_id: 1})  # b is dead
    assert b.node_id in a.index.reap_dead_nodes(grace_ms=0)
    assert not client.exists("x2")  # its one replica went with b
    with pytest.raises(MooncakeError):
        client.get("x1")


def test_a_connection_of_a_client_reads_on_after_a_hostile_record(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The client's own connection to the index is dropped on such a reply, not left mid-stream."""
    cluster = make_cluster(1)
    client = make_client(cluster, timeout_s=5.0)
    client.put("bad", b"b")
    client.index.redis.hset(client.index.prefix + "o:bad", "dtype", b"\xff")
    other = connect(cluster.redis_url, namespace=cluster.namespace, timeout_s=5.0)
    try:
        for i in range(5):
            with pytest.raises(ProtocolError):
                client.get("bad")
            client.put(f"ok{i}", b"k")
            assert other.get(f"ok{i}").tobytes() == b"k"
    finally:
        other.close()


def test_a_replica_offset_that_is_no_integer_is_malformed_not_read_one_byte_off(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """int(8.5) made it 8: the read copied from one byte before the object, the wrong bytes with
    no error unless the client verified checksums."""
    client = make_client(make_cluster(1), timeout_s=5.0)
    client.put("before", np.zeros(4096, np.uint8))
    value = np.arange(4096, dtype=np.uint16).astype(np.uint8)
    client.put("shifted", value)
    r, p = client.index.redis, client.index.prefix
    reps = json.loads(r.hget(p + "o:shifted", "replicas"))
    reps[0][2] = reps[0][2] + 0.5
    r.hset(p + "o:shifted", "replicas", json.dumps(reps))
    with pytest.raises(ProtocolError, match="no integer"):
        client.get("shifted")
