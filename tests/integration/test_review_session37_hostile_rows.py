"""Node rows and pin sets not of this build's making (written by hand, by another build, or
damaged), as the index's scripts meet them (thirty-seventh session). README: one bad record fails
only what touches it. Each case here broke that:

- a node row no JSON decodes failed every registration of its node id with cjson's error (a start
  over a dead node's row, with no other agent to reap it, failed for good), and the commit of every
  put batch that named the node;
- an agent whose own row was made so failed every heartbeat; alone in its cluster it was never
  reaped (agents reaped only after a beat of their own went through), so it never registered again
  and its node stayed unreadable for good;
- a pins key of another Redis type failed every remove, commit, eviction and prefix match of its
  key with a WRONGTYPE naming no key."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mooncake_store import Client, PrefixCache
from mooncake_store.agent.node import Agent
from mooncake_store.index.node_table import NodeIdTaken

MiB = 1 << 20


def test_a_start_over_a_dead_node_row_no_json_decodes_registers(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    client = client_of(namespace)
    client.index.redis.hset(client.index.prefix + "nodes", "dx-garbled", "garbage{")  # no deadline: dead
    agent = direct_agent(namespace, node_id="dx-garbled")
    assert "dx-garbled" in client._node_table(refresh=True)
    client.put("k", b"value", preferred_node=agent.node_id)
    assert client.get("k").tobytes() == b"value"


def test_a_start_over_a_live_row_no_json_decodes_is_refused_naming_it(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    client = client_of(namespace)
    r, p = client.index.redis, client.index.prefix
    r.hset(p + "nodes", "dx-garbled", "garbage{")
    r.zadd(p + "hb", {"dx-garbled": client.index.server_time_ms() + 60_000})
    with pytest.raises(NodeIdTaken, match=r"cannot read \('garbage\{'") as caught:
        direct_agent(namespace, node_id="dx-garbled")
    assert 55_000 < caught.value.left_ms <= 60_000


def test_an_agent_whose_own_row_is_garbled_alone_registers_again(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    agent = direct_agent(namespace, heartbeat_interval_s=0.1, heartbeat_ttl_s=0.4)
    client = client_of(namespace)
    r, p = client.index.redis, client.index.prefix
    r.hset(p + "nodes", agent.node_id, "garbage{")
    # Its beats fail; past its deadline and its TTL it is reaped (by itself, the only agent), and
    # its next beat registers it again. Bounded: 100 polls.
    for _ in range(100):
        if agent.node_id in client._node_table(refresh=True):
            break
        time.sleep(0.1)
    assert agent.node_id in client._node_table(refresh=True), "the agent never registered again"
    client.put("after", np.arange(1000, dtype=np.int32))
    assert np.array_equal(client.get("after"), np.arange(1000, dtype=np.int32))


def test_a_commit_naming_a_node_whose_row_no_json_decodes_places_the_put_again(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    agents = {a.node_id for a in (direct_agent(namespace), direct_agent(namespace))}
    client = client_of(namespace)
    r, p = client.index.redis, client.index.prefix
    real_commit = client.index.put_commit
    garbled: list[str] = []

    def garble_then_commit(put_ids: Any, **kwargs: Any) -> list[str]:
        # Between the bytes' landing and the first commit, the row of the node they landed on is
        # garbled: the commit refuses that reservation, as one on a node that left the table.
        if not garbled:
            entry = json.loads(r.hget(p + "pend:" + put_ids[0], "entry"))
            garbled.append(entry["replicas"][0][0])
            r.hset(p + "nodes", garbled[0], "garbage{")
        return real_commit(put_ids, **kwargs)

    client.index.put_commit = garble_then_commit  # type: ignore[method-assign]
    client.put("k", b"value")
    (other,) = agents - set(garbled)
    (meta,) = client.index.lookup(["k"], lease_ms=0).objects
    assert meta is not None and [rep.node_id for rep in meta.replicas] == [other]
    assert client.get("k").tobytes() == b"value"


@pytest.mark.parametrize("kind", ["string", "list"])
def test_a_pins_key_of_another_type_holds_no_pin(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, kind: str
) -> None:
    agent = direct_agent(namespace)
    client = client_of(namespace)
    r, p = client.index.redis, client.index.prefix

    def garble(key: str) -> None:
        if kind == "string":
            r.set(p + "pins:" + key, "garbage")
        else:
            r.rpush(p + "pins:" + key, "garbage")

    client.put_many({"a": b"aa", "b": b"bb", "c": b"cc"})
    garble("a")
    client.put("a", b"a2")  # a replacement commits
    assert client.get("a").tobytes() == b"a2"
    garble("b")
    sampled = {c.key: c for c in client.index.victim_candidates(agent.node_id, "host")}
    assert sampled["b"].pins == 0  # a pressure pass samples it as unpinned
    assert client.remove_many(["b", "c"]) == [True, True]  # the whole batch, the pins key with it
    assert not r.exists(p + "pins:b")
    garble("a")
    with PrefixCache(client, f"pins-{kind}/u8/L1/kv1/d16/tp0", chunk_tokens=4) as cache:
        tokens = list(range(8))
        cache.store(tokens, [np.full(16, i, np.uint8) for i in range(2)])
        for key in cache.keys(tokens):
            garble(key)
        assert cache.match(tokens) == 8
        with cache.load(tokens) as hit:  # pins its chunks: the garbage is replaced
            assert hit.num_tokens == 8
            assert [bytes(np.asarray(c)) for c in hit.chunks] == [bytes([i]) * 16 for i in range(2)]
            assert client.index.redis.type(p + "pins:" + hit.keys[0]) == "zset"
