"""Review of visibility: what ``client.stat()`` (and so ``mooncake stat``) shows per node and tier
(session 4, stats).

Each test fails on the code as reviewed, for the reason its docstring gives. Real agents (in this
process), the session's real Redis/Valkey, real TCP transfers; the test itself takes the steps an
agent's pressure thread would take where a move must be placed exactly (as in
tests/integration/test_review_session4_disk.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
from helpers import beat_since, host_replica, wait_until

from mooncake_store import connect
from mooncake_store.agent.node import Agent
from mooncake_store.client.stats import ClusterStats, TierStats
from mooncake_store.transport.frames import SPILL_FLAG
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import TierKind

MiB = 1 << 20
SIZE = 64 << 10


def _tier(stats: ClusterStats, node_id: str, tier: str) -> TierStats:
    node = next(n for n in stats.nodes if n.node_id == node_id)
    return next(t for t in node.tiers if t.tier == tier)


def _no_pressure_loop(agent: Agent) -> None:
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------
def test_host_tier_reads_served_over_tcp_are_counted(make_inproc_agent: Callable[..., Agent], redis_url: str) -> None:
    """TierStats.reads is "reads the agent served itself (TCP, disk)", but a TCP read of a host-tier
    object is counted only in AgentServer.counters (agent/server.py:194), which nothing publishes:
    Agent.tiers() (agent/node.py:129) sends pressure.counters[HOST], where no "reads" is ever
    counted. The host row of `mooncake stat` shows reads 0 however many reads the agent served."""
    agent = make_inproc_agent(heartbeat_interval_s=0.2)
    with connect(redis_url, namespace=agent.namespace, transports=("tcp",)) as client:
        value = np.arange(SIZE, dtype=np.uint8)
        client.put("k", value, preferred_node=agent.node_id)
        for _ in range(3):
            assert np.array_equal(client.get("k"), value)
        # The agent did serve them, over TCP (it counts each just after sending its reply).
        assert wait_until(lambda: agent.server.counters["reads"] >= 3, 2.0)
        # Counters reach the node table with the next heartbeat (every 0.2 s here).
        wait_until(lambda: _tier(client.stat(), agent.node_id, "host").reads >= 3, 3.0)
        reads = _tier(client.stat(), agent.node_id, "host").reads
        assert reads >= 3, f"host tier shows {reads} reads; the agent served {agent.server.counters['reads']}"


# ---------------------------------------------------------------------------------------------
def test_spills_in_counts_only_spills_that_landed(make_inproc_agent: Callable[..., Agent], redis_url: str) -> None:
    """spills_in is counted when a peer's RESERVE with SPILL_FLAG is granted
    (agent/server.py:258 and :245 -> Agent.spilled_in, agent/node.py:255), not when a spilled object
    arrives: a spill whose compare-and-swap is refused (the object was removed, replaced, pinned or
    moved meanwhile, spill.py _swap) or whose batch was reserved ahead and given back
    (spill.py _give_back) is counted as spilled in on the peer, while the sender rightly counts no
    spill out. Cluster-wide, spills in then exceed spills out, and the peer shows objects that
    never came."""
    ns = f"t-{uuid.uuid4().hex[:10]}"
    a = make_inproc_agent(namespace=ns, heartbeat_interval_s=0.2)
    b = make_inproc_agent(namespace=ns, heartbeat_interval_s=0.2)
    with connect(redis_url, namespace=ns) as client:
        value = np.full(SIZE, 0xAA, dtype=np.uint8)
        client.put("obj", value, preferred_node=a.node_id)
        meta = client.object_meta("obj")
        assert meta is not None and meta.replicas[0].node_id == a.node_id
        old = meta.replicas[0]
        # a's pressure thread spills "obj" to b exactly as agent/spill.py does: guard, RESERVE
        # (SPILL_FLAG), WRITE, then one compare-and-swap.
        put_id = uuid.uuid4().bytes
        client.index.guard_reservations([put_id.hex()], node_id=b.node_id, ttl_ms=60_000)
        tcp = TcpTransport(timeout_s=10.0, connections_per_peer=1, stripe_bytes=1 << 30)
        try:
            peer = tcp.peer(b.server.endpoint)
            (res,) = peer.reserve([(SIZE, put_id)], node_id=b.node_id, flags=SPILL_FLAG)
            peer.write(res.alloc_id, res.offset, memoryview(value))
            assert client.remove("obj")  # meanwhile the object went
            new = host_replica(b.node_id, res, SIZE)
            (status,) = client.index.move_replicas([("obj", old.alloc_id, new, put_id.hex())], old_node=a.node_id)
            assert status == "GONE"  # the swap is refused: nothing was spilled
            peer.free([res.alloc_id])  # as Spiller._swap expires every reservation not swapped
        finally:
            tcp.close()
        b.sync_once()
        synced = time.monotonic()
        # Counters reach the node table with the next heartbeat (every 0.2 s here).
        assert wait_until(lambda: all(beat_since(client, synced, n.node_id) for n in (a, b)), 10)
        stats = client.stat()
        out = _tier(stats, a.node_id, "host").spills_out
        into = _tier(stats, b.node_id, "host").spills_in
        assert out == 0
        assert into == 0, f"b counts {into} spill(s) in that never landed (a spilled out {out})"


# ---------------------------------------------------------------------------------------------
def test_hits_are_credited_to_the_replica_a_reader_takes(
    make_inproc_agent: Callable[..., Agent], redis_url: str, tmp_path: Path
) -> None:
    """lookup.lua credits a hit to the first live replica in the record ("the one a reader on
    another host takes", lookup.lua:51-53). Moves swap a replica in place (prelude.lua
    swap_replica: reps[found] = new), so once node A demotes its copy of a replicas=2 object to disk
    the record reads [A disk, B host]; every reader takes B's host copy (transport_choice: host
    before gpu before disk on any one path), yet every hit lands on A's disk tier, which served
    nothing, and B's host tier, which served them all, shows 0 hits."""
    ns = f"t-{uuid.uuid4().hex[:10]}"
    a = make_inproc_agent(
        namespace=ns,
        prepare=_no_pressure_loop,
        host_bytes=8 * MiB,
        disk_path=str(tmp_path),
        disk_bytes=16 * MiB,
        promote_on_read=False,
    )
    b = make_inproc_agent(namespace=ns, host_bytes=8 * MiB)
    with connect(redis_url, namespace=ns, transports=("tcp",)) as client:
        value = np.arange(SIZE // 2, dtype=np.float16)
        client.put("obj", value, replicas=2, preferred_node=a.node_id)
        meta = client.object_meta("obj")
        assert meta is not None and [r.node_id for r in meta.replicas] == [a.node_id, b.node_id]
        # A's pressure pass demotes its copy to its disk tier (moves.demote_to_disk).
        (victim,) = [c for c in a.index.victim_candidates(a.node_id, "host") if c.key == "obj"]
        location = a.table.offset_of(victim.alloc_id)
        assert location is not None and a.pressure.moves.demote_to_disk(victim, location[0])
        meta = client.object_meta("obj")
        assert meta is not None
        assert [(r.node_id, r.tier) for r in meta.replicas] == [(a.node_id, TierKind.DISK), (b.node_id, TierKind.HOST)]

        b_reads = b.server.counters["reads"]
        for _ in range(3):
            assert np.array_equal(client.get("obj"), value)
        # B's host tier served every read (counted just after each reply went out).
        assert wait_until(lambda: b.server.counters["reads"] == b_reads + 3, 2.0)
        assert a.pressure.counters[TierKind.DISK]["reads"] == 0  # A's disk served none

        stats = client.stat()
        assert stats.hits == 3
        assert _tier(stats, b.node_id, "host").hits == 3, (
            f"B host hits {_tier(stats, b.node_id, 'host').hits}, A disk hits {_tier(stats, a.node_id, 'disk').hits}"
        )


# ---------------------------------------------------------------------------------------------
def test_a_restarted_agent_does_not_inherit_its_predecessors_hits(
    make_inproc_agent: Callable[..., Agent], redis_url: str
) -> None:
    """Every per-tier counter in stat() is the agent's own (reset when it restarts: "what each
    node's tiers did since their agents started", cli/render.py activity_table) except hits, which
    live in the index's stats hash as hits:<node>:<tier> (lookup.lua:59) and are never cleared when
    a node leaves (node_deregister.lua, node_reap.lua) or a new incarnation registers under the same
    id (node_register.lua). A restarted node's row shows 0 objects and 0 reads next to the hits of
    the memory that no longer exists; a `stat --watch` consumer cannot tell one incarnation from
    the next (NodeStats carries no started_ms)."""
    ns = f"t-{uuid.uuid4().hex[:10]}"
    node_id = f"rv4s-{uuid.uuid4().hex[:6]}"
    first = make_inproc_agent(namespace=ns, node_id=node_id)
    with connect(redis_url, namespace=ns) as client:
        value = np.arange(SIZE, dtype=np.uint8)
        client.put("k", value, preferred_node=node_id)
        for _ in range(4):
            assert np.array_equal(client.get("k"), value)
        assert _tier(client.stat(), node_id, "host").hits == 4
        first.stop()  # leaves the cluster; its objects leave the index

        make_inproc_agent(namespace=ns, node_id=node_id)  # the node comes back, empty
        stats = client.stat()
        row = _tier(stats, node_id, "host")
        assert row.objects == 0 and row.reads == 0 and row.evictions == 0
        assert row.hits == 0, f"the new incarnation of {node_id} shows {row.hits} hits of its predecessor"
