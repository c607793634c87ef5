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
from pathlib import Path

import numpy as np
import pytest

from mooncake_store import LocalCluster, connect
from mooncake_store.embedded import EmbeddedServer

VALUE = np.arange(4096, dtype=np.uint8)


def test_an_index_outage_does_not_get_a_short_ttl_node_reaped_by_a_long_ttl_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = EmbeddedServer(persist_dir=tmp_path / "aof").start()
    again: EmbeddedServer | None = None
    try:
        with LocalCluster(0, redis_url=server.url, namespace="mixed-ttl", heartbeat_ttl_s=10.0) as cluster:
            # The patient agent beats often (its TTL 10 s); the short one with its TTL 1.5 s, 1 s beats.
            monkeypatch.setenv("MOONCAKE_AGENT_HEARTBEAT_INTERVAL_S", "0.1")
            cluster.add_agent(node_id="patient")
            monkeypatch.setenv("MOONCAKE_AGENT_HEARTBEAT_INTERVAL_S", "1.0")
            cluster.add_agent(node_id="short", extra_args=["--heartbeat-ttl-s", "1.5"])
            with connect(server.url, namespace="mixed-ttl", timeout_s=10.0) as client:
                client.put("on-short", VALUE, preferred_node="short")
                tag = client.index.nodes()["short"].alloc_tag
                time.sleep(1.5)  # the AOF has it all
                os.kill(server.pid, signal.SIGKILL)
                server.stop()
                time.sleep(4.0)  # past short's deadline + its own grace (3 s); far within patient's TTL
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
