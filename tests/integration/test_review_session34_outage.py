"""An index outage (server killed, restarted from its append-only file on the same port)
longer than a short-TTL agent's grace but shorter than a long-TTL peer's TTL. README: "Losing the
index is no node's death ... the first heartbeat back gives each node its own grace again", and
agents with different heartbeat_ttl_s may share a cluster. The long-TTL agent's heartbeat lands
first; heard_from_a_node (prelude.lua) gave grace again only when the silence passed the *caller's*
TTL, so it did not, and the same agent's reap right after purged its healthy short-TTL peer. The
caller's heartbeat interval now tells the outage, and each node whose grace it passed gets it."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from helpers import node_row

from mooncake_store import LocalCluster, connect
from mooncake_store.embedded import EmbeddedServer
from mooncake_store.index.client import RedisIndex

VALUE = np.arange(4096, dtype=np.uint8)


def test_an_index_outage_does_not_get_a_short_ttl_node_reaped_by_a_long_ttl_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = EmbeddedServer(persist_dir=tmp_path / "aof").start()
    again: EmbeddedServer | None = None
    try:
        with LocalCluster(0, redis_url=server.url, namespace="mixed-ttl", heartbeat_ttl_s=10.0) as cluster:
            # The patient agent beats often (its TTL 10 s); the short one with its TTL 2.5 s, 0.5 s beats
            # (five beats in its grace after the outage, for its reconnection to land one).
            monkeypatch.setenv("MOONCAKE_AGENT_HEARTBEAT_INTERVAL_S", "0.1")
            cluster.add_agent(node_id="patient")
            monkeypatch.setenv("MOONCAKE_AGENT_HEARTBEAT_INTERVAL_S", "0.5")
            cluster.add_agent(node_id="short", extra_args=["--heartbeat-ttl-s", "2.5"])
            with connect(server.url, namespace="mixed-ttl", timeout_s=10.0) as client:
                client.put("on-short", VALUE, preferred_node="short")
                tag = client.index.nodes()["short"].alloc_tag
                time.sleep(1.5)  # the AOF has it all
                os.kill(server.pid, signal.SIGKILL)
                server.stop()
                time.sleep(6.0)  # past short's deadline + its own grace (5 s); far within patient's TTL
                again = EmbeddedServer(port=server.port, persist_dir=tmp_path / "aof").start()
                assert client.exists("on-short") in (True, False)  # the index answers again
                time.sleep(3.0)  # both agents beat again; patient reaps after each of its beats (every 0.1 s)
                nodes = client.index.nodes()
                assert "short" in nodes
                assert all(a.alive() for a in cluster.agents)
                assert nodes["short"].alloc_tag == tag
                assert client.exists("on-short"), "a healthy node was reaped with its objects after an index outage"
                assert np.array_equal(client.get("on-short"), VALUE)
    finally:
        if again is not None:
            again.stop()
        server.stop()


def _short_node_past_its_grace_in_an_outage(index: RedisIndex) -> None:
    """ "patient" (10 s TTL) and "short" (1.5 s) registered; then 4 s of silence of the index
    (hb_last), in which short's deadline and grace passed: as the index has it after an outage.
    (The index's scripts as agents call them; the clock moved by setting what beats would leave.)"""
    for node in ("patient", "short"):
        index.register_node(node_row(node), incarnation=f"inc-{node}", ttl_ms=10_000)
    now = index.server_time_ms()
    index.redis.set(index.prefix + "hb_last", now - 4_000)
    index.redis.zadd(index.prefix + "hb", {"patient": now + 6_000, "short": now - 2_500})
    index.redis.zadd(index.prefix + "reap", {"patient": now + 16_000, "short": now - 1_000})


def test_a_reap_run_after_an_outage_before_any_beat_spares_the_node_the_outage_made_late(redis_url: str) -> None:
    """Sent before the outage and run after it (a stalled server runs what it queued), the reap of
    a 10 s-TTL agent was guarded by its own TTL alone and purged the 1.5 s-TTL peer."""
    index = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}")
    try:
        _short_node_past_its_grace_in_an_outage(index)
        assert index.reap_dead_nodes(older_grace_ms=10_000, reaper="patient") == []
        assert "short" in index.nodes()
    finally:
        index.redis.delete(*index.redis.keys(index.prefix + "*"))
        index.close()


def test_a_registration_landing_first_after_an_outage_gives_late_nodes_their_grace(redis_url: str) -> None:
    """A registration (a start, or one after a vanished record) first to land after the outage reset
    the silence without giving the short-TTL node its grace again; the next reap purged it."""
    index = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}")
    try:
        _short_node_past_its_grace_in_an_outage(index)
        index.register_node(node_row("newcomer"), incarnation="inc-newcomer", ttl_ms=10_000)
        assert index.reap_dead_nodes(older_grace_ms=10_000, reaper="newcomer") == []
        assert "short" in index.nodes()
    finally:
        index.redis.delete(*index.redis.keys(index.prefix + "*"))
        index.close()
