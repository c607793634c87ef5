"""The last live copy of a replicated object whose spill a peer refuses stays where it is.

A pressure pass plans its spills from the node table, which is a heartbeat old: a peer that filled
since refuses the spill's reservation, and the pass places what it did not take again (another
peer, a demotion, else an eviction). A survivor (the last live copy of a replicas=2 object whose
other holder died, before its repair) is left for the next pass instead: evicted there, the object
the user was promised survives one node's death was lost to it (pressure.py, _carry_out_spills).

Real in-process Agents on the session's real Redis-compatible server, their passes and syncs run
by the test; the peer's node-table row is stale as it would be between two heartbeats."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from test_pressure import pin

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

MiB = 1 << 20


def value_of(key: str, size: int = MiB) -> np.ndarray:
    return np.full(size, sum(key.encode()) % 251, dtype=np.uint8)


def test_a_survivor_whose_spill_the_peer_refuses_is_not_evicted(
    make_peer_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    a = make_peer_agent(host_bytes=8 * MiB)
    b = make_peer_agent(host_bytes=8 * MiB)
    client = clients(a, timeout_s=20)
    client.put("two", value_of("two"), replicas=2, preferred_node=a.node_id)
    holders = {r.node_id for r in client.object_meta("two").replicas}  # type: ignore[union-attr]
    assert holders == {a.node_id, b.node_id}, holders
    # A past its high watermark with pinned objects only, but for "two".
    fill = [f"pinned/{i}" for i in range(13)]
    for key in fill:
        client.put(key, value_of(key, MiB // 2), preferred_node=a.node_id)
        pin(client, key)
    # The peer joins with room, as its row says, and fills up before its next heartbeat.
    c = make_peer_agent(host_bytes=8 * MiB)
    for i in range(15):
        client.put(f"c/{i}", value_of(f"c/{i}", MiB // 2), preferred_node=c.node_id)
    for agent in (a, b, c):
        agent.sync_once()
    assert c.table.usage()[0] > c.config.high_watermark * c.table.capacity_bytes
    # B dies (past its heartbeat deadline, not yet reaped): A's copy of "two" is its last live one.
    client.index.redis.zadd(client.index.prefix + "hb", {b.node_id: 1})
    (victim,) = [v for v in a.index.victim_candidates(a.node_id, str(TierKind.HOST)) if v.key == "two"]
    assert victim.survivor
    a.pressure.relieve_host()
    assert a.pressure.counters[TierKind.HOST]["spills_out"] == 0  # the peer refused it
    replicas = client.index.replicas_listed("two")
    assert replicas is not None and any(r.node_id == a.node_id for r in replicas), (
        f"the last live copy of a replicas=2 object was evicted when its spill was refused: {replicas}"
    )
    assert a.pressure.counters[TierKind.HOST]["evictions"] == 0
