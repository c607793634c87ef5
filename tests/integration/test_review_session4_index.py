"""Review of the Redis index (session 4): each test fails on the code as reviewed, for the reason
its docstring gives. Real Redis, real agents (in process, so an interleaving can be placed)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
import redis
from redis_proxy import RedisProxy

from mooncake_store import connect
from mooncake_store.agent.node import Agent
from mooncake_store.errors import ConnectError
from mooncake_store.index import client as index_client
from mooncake_store.index.client import NodeSuperseded, RedisIndex
from mooncake_store.index.prefix import PrefixIndex

SIZE = 64 << 10


def _key(tag: str) -> str:
    return f"rv4i-{tag}-{uuid.uuid4().hex[:8]}"


def test_a_put_reserved_on_a_dead_incarnation_cannot_commit_onto_its_successor(
    make_inproc_agent: Callable[..., Agent], redis_url: str
) -> None:
    """put_commit.lua:22-24 refuses a replica only when its node id left the node table. A node that
    crashed after granting a reservation and came back under the same node id (a new incarnation,
    a new arena, alloc ids with a new tag) passes that check: the late commit of the old
    reservation answers OK and the index names the old incarnation's alloc id at an offset of the
    new arena. The new agent never heard of that alloc, hands the offset to the next put, and a get
    of the committed key returns the other object's bytes (no error)."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    node_id = f"rv-{uuid.uuid4().hex[:6]}"
    first = make_inproc_agent(namespace=namespace, node_id=node_id)
    client = connect(redis_url, namespace=namespace)
    try:
        ghost = _key("ghost")
        puts = client._puts
        (plan,) = puts.plan({ghost: np.full(SIZE, 0xAA, dtype=np.uint8)}, chain_pos=None, chain_parent=None)
        nodes = puts.reserver.reserve([plan], 1, None)
        client.index.put_start([plan.pending()], ttl_ms=60_000)
        puts.writes.write_replica(nodes[node_id], plan.replicas[0], plan)
        first.stop()  # the node goes away (crash or restart) between the write and the commit
        make_inproc_agent(namespace=namespace, node_id=node_id)  # ... and comes back under its id
        statuses = client.index.put_commit([plan.put_id.hex()])
        other = _key("other")
        client.put(other, np.full(SIZE, 0x55, dtype=np.uint8))
        seen = None
        if client.exists(ghost):
            seen = bytes(client.get(ghost).tobytes()[:4])
        assert statuses == ["GONE"], (
            f"commit of a reservation of the previous incarnation answered {statuses}; "
            f"get({ghost!r}) then returned {seen!r}... (the put wrote 0xAA)"
        )
    finally:
        client.close()


def test_a_node_whose_reap_began_cannot_heartbeat_back_to_life_half_purged(
    make_inproc_agent: Callable[..., Agent], redis_url: str
) -> None:
    """node_reap.lua purges a dead node in bounded steps (max_keys, shared by up to 16 nodes), and
    purge_node (prelude.lua:75-99) removes the node record only at the last step. node_heartbeat
    .lua:8-11 checks only that the record exists under the same incarnation, so an agent that was
    stalled past deadline + grace and wakes between two reap steps gets OK, is live again, and the
    reaper never picks it again. The keys already stripped are gone from the index (objects lost
    although their only replica's bytes still live) and their blocks stay allocated on the agent:
    no grave names them and the agent never dropped them (it drops everything only on UNKNOWN)."""
    agent = make_inproc_agent(heartbeat_interval_s=3000.0, heartbeat_ttl_s=3600.0)
    client = connect(redis_url, namespace=agent.namespace)
    try:
        keys = [_key(str(i)) for i in range(6)]
        for key in keys:
            client.put(key, np.full(SIZE, 7, dtype=np.uint8))
        agent.sync_once()  # the agent learns its commits
        index = client.index
        index.redis.zadd(index.prefix + "hb", {agent.node_id: 0})  # stalled past deadline + grace
        assert index.reap_dead_nodes(grace_ms=0, max_keys=2) == []  # a first, partial reap step
        # The agent wakes up and heartbeats, exactly as its heartbeat loop does.
        alive = agent.index.heartbeat(
            agent.node_id, incarnation=agent.incarnation, ttl_ms=agent._ttl_ms, tiers=agent.tiers()
        )
        index.reap_dead_nodes(grace_ms=0)  # later reaper rounds
        still = [k for k in keys if client.exists(k)]
        held = len(agent.table)
        assert not alive or len(still) == len(keys), (
            f"heartbeat answered OK after a partial reap: {len(still)}/{len(keys)} keys left in the "
            f"index, the agent still holds {held} blocks, none in its graveyard "
            f"({index.redis.zcard(index.prefix + 'gc:' + agent.node_id)})"
        )
    finally:
        client.close()


def test_a_superseded_incarnation_cannot_drain_the_acks_of_its_successor(
    make_inproc_agent: Callable[..., Agent], redis_url: str
) -> None:
    """agent_sync.lua:18-31 drains acks:<node id> for whoever calls with that node id: the script
    takes no incarnation. An agent that stalled past its deadline is taken over by a new agent under
    the same node id (node_register.lua:15 lets a new incarnation in once the deadline passed). The
    old process wakes up; its heartbeat gets UNKNOWN, its re-registration IN_USE (a MooncakeError the
    heartbeat loop does not catch), but its sync loop goes on and takes the new agent's acks. The new
    agent never learns its commit: its reservation expires, agent_sync says "G", plan_sync frees it,
    and the next put lands on the committed object's block; a get then returns the other bytes."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    node_id = f"rv-{uuid.uuid4().hex[:6]}"
    old = make_inproc_agent(namespace=namespace, node_id=node_id, heartbeat_interval_s=3000.0, heartbeat_ttl_s=3600.0)
    client = connect(redis_url, namespace=namespace)
    try:
        client.index.redis.zadd(client.index.prefix + "hb", {node_id: 0})  # the old agent stalls
        new = make_inproc_agent(namespace=namespace, node_id=node_id)  # a replacement takes the id over
        assert new.incarnation != old.incarnation
        key = _key("committed")
        client.put(key, np.full(SIZE, 0x11, dtype=np.uint8))  # onto the new agent, the only live node
        # The stalled agent wakes up: its sync loop runs before anything stops it, and is refused.
        with pytest.raises(NodeSuperseded):
            old.sync_once()
        time.sleep(new.config.reserve_timeout_s + 0.2)
        new.sync_once()  # the reservation looks expired and its record gone ("G") with no ack
        client.put(_key("other"), np.full(SIZE, 0x22, dtype=np.uint8))
        got = client.get(key).tobytes()[:4]
        assert got == b"\x11" * 4, f"get({key!r}) returned {got!r}: the new agent freed the block of a committed object"
    finally:
        client.close()


def test_a_call_whose_connection_broke_too_late_is_not_run_a_second_time(
    proxy: RedisProxy, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script call that is not replay-safe carries a token under which the server keeps its
    reply ONCE_TTL_MS for the retry that follows a broken connection. The retry was made however
    late the break was seen (this process stalled, a reply lost late), and past that TTL it ran
    the call again (an agent_sync run twice loses the acks the first run carried). Now a call
    is retried only within RETRY_WITHIN_S of its sending, here shortened to 0.3 s with the break
    seen 0.6 s after the server ran the call."""
    monkeypatch.setattr(index_client, "RETRY_WITHIN_S", 0.3)
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    index = RedisIndex(proxy.url, namespace=namespace)
    direct = redis.Redis.from_url(redis_url)
    try:
        prefix = PrefixIndex(index)
        for script in prefix._scripts.values():  # a NOSCRIPT round trip must not absorb the fault
            direct.script_load(script.script)
        proxy.drop_reply(str(prefix._scripts["prefix_claim"].sha), delay_s=0.6)
        with pytest.raises(ConnectError, match="too late to retry safely"):
            prefix.claim(["late-claim"], writer_id="w1", ttl_ms=60_000)
        assert direct.exists(index.prefix + "claim:late-claim"), "the call did not run at all"
        # A break seen at once is retried as before (the stored reply comes back).
        proxy.drop_reply(str(prefix._scripts["prefix_claim"].sha))
        assert prefix.claim(["quick-claim"], writer_id="w1", ttl_ms=60_000) == ["MINE"]
    finally:
        index.close()
        direct.close()
