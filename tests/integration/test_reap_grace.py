"""A dead node's grace past its heartbeat deadline is its own TTL, not its reaper's. Agents of one
cluster may run with different TTLs (a node that tolerates long pauses sets a long one). Each
reaper used its own TTL as the grace and reaped once per its own TTL, so a long-TTL node that
stalled was reaped by a short-TTL peer long before its own TTL ran out, and a short-TTL node that
died waited for its long-TTL peers' schedule. Real agent processes and the session's real Valkey."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

import numpy as np
from helpers import node_row, stop_process, wait_until

from mooncake_store import Client, LocalCluster
from mooncake_store.client.cluster import AgentProcess
from mooncake_store.index.client import RedisIndex

VALUE = np.arange(4096, dtype=np.uint8)


def two_ttls(
    make_cluster: Callable[..., LocalCluster],
    make_client: Callable[..., Client],
    first: tuple[str, float],
    second: tuple[str, float],
) -> tuple[AgentProcess, Client]:
    """Two agents of (node id, heartbeat TTL s), and VALUE stored on the second as "on-<its id>"."""
    cluster = make_cluster(0, heartbeat_ttl_s=first[1])
    cluster.add_agent(node_id=first[0])
    agent = cluster.add_agent(node_id=second[0], extra_args=["--heartbeat-ttl-s", str(second[1])])
    client = make_client(cluster)
    client.put(f"on-{second[0]}", VALUE, preferred_node=second[0])
    return agent, client


def test_a_short_ttl_node_that_dies_is_reaped_after_its_own_ttl(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    short, client = two_ttls(make_cluster, make_client, ("patient", 30.0), ("short", 1.5))
    short.process.kill()
    short.process.wait(timeout=10)
    died = time.monotonic()
    # Its deadline is at most 1.5 s away, its grace 1.5 s more, and the patient agent reaps at each
    # of its 1 s heartbeats: its record goes within ~4 s (it took ~60 s: the 30 s TTL as grace, a
    # reap every 30 s).
    assert wait_until(lambda: "short" not in client.index.nodes(), 15.0), client.index.nodes()
    assert time.monotonic() - died < 15.0
    assert client.exists("on-short") is False  # its only replica went with it
    assert "patient" in client.index.nodes()


def test_a_long_ttl_node_that_stalls_within_its_ttl_is_not_reaped_by_a_short_ttl_peer(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    patient, client = two_ttls(make_cluster, make_client, ("hasty", 1.5), ("patient", 9.0))
    tag = client.index.nodes()["patient"].alloc_tag
    stop_process(patient.pid)
    try:
        # Its deadline passes 8-9 s into the stall; its grace runs to 17-18 s. The hasty agent
        # reaped it with its own 1.5 s grace, 11-12.5 s in at the latest.
        time.sleep(13.5)
        assert "patient" in client.index.nodes(), "reaped within its own TTL's grace"
    finally:
        os.kill(patient.pid, signal.SIGCONT)
    # Awake, it heartbeats again under the same incarnation and its object is still there.
    assert wait_until(lambda: client.stat().nodes and all(n.alive for n in client.stat().nodes), 10.0)
    assert client.index.nodes()["patient"].alloc_tag == tag  # not reaped and registered again
    assert np.array_equal(client.get("on-patient"), VALUE)


def test_stalled_long_ttl_nodes_never_hold_back_the_reap_of_a_dead_short_ttl_one(redis_url: str) -> None:
    """Reapers find nodes by when their grace ends, not by their deadline: a first version scanned
    the 256 oldest deadlines and skipped those still in their grace, so 256 stalled long-TTL nodes
    hid every node behind them. Also, one reaper at a time: another's call within the turn purges
    nothing. (The index's scripts on the session's real Valkey, as agents call them; the clock is
    moved by setting the deadlines and reap times that heartbeats would have left.)"""
    index = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}", timeout_s=60.0)
    try:
        now = index.server_time_ms()
        stalled = [f"stalled-{i}" for i in range(300)]
        for node in [*stalled, "short"]:
            index.register_node(node_row(node), incarnation=f"inc-{node}", ttl_ms=3_600_000)
        # 300 nodes with an hour's TTL, 10 s past their deadline; "short" (1 s TTL) 5 s past its.
        index.redis.zadd(index.prefix + "hb", {**{n: now - 10_000 for n in stalled}, "short": now - 5_000})
        index.redis.zadd(index.prefix + "reap", {**{n: now + 3_590_000 for n in stalled}, "short": now - 4_000})
        index.redis.hset(index.prefix + "nodes", "broken", "not json")  # a record no script can decode
        first = index.reap_dead_nodes(older_grace_ms=5000, reaper="one", turn_ms=60_000)
        assert first == ["short"]
        index.redis.zadd(index.prefix + "hb", {"gone": 1})  # deregistered, say: due at once
        index.redis.zadd(index.prefix + "reap", {"gone": 1})
        assert index.reap_dead_nodes(older_grace_ms=5000, reaper="two", turn_ms=60_000) == []  # one's turn
        assert index.reap_dead_nodes(older_grace_ms=5000, reaper="two", turn_ms=0) == ["gone"]
        assert set(index.redis.hkeys(index.prefix + "nodes")) == {*stalled, "broken"}
    finally:
        index.redis.delete(index.prefix + "nodes", index.prefix + "hb", index.prefix + "reap", index.prefix + "reaper")
        index.close()
