"""Review pass 5, durability ("nothing lost when a node dies", DESIGN.md §3 invariant 7): each test
shows a way an object that was never removed becomes unreadable, or silently loses its redundancy,
around a node that dies or stalls.

Real components only: LocalCluster agent subprocesses (SIGKILL / SIGSTOP by PID), in-process Agents
where an interleaving must be placed exactly, the session's real Valkey server.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers import count_read_requests, guarded_spill_copy, stop_process, wait_until

from mooncake_store import Client, LocalCluster, PrefixCache, connect
from mooncake_store.agent.node import Agent
from mooncake_store.client.cluster import AgentProcess

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def _past_deadline(client: Client, node_id: str) -> bool:
    """The node is still in the node table (not reaped) but its heartbeat deadline has passed:
    dead to every reader, not yet purged."""
    node = client.index.nodes().get(node_id)
    return node is not None and node.heartbeat_deadline_ms < client.index.server_time_ms()


def _wait_dead_not_reaped(client: Client, node_id: str) -> None:
    """Wait until the killed node is past its deadline, and keep it from being reaped while the
    test goes on: a survivor reaps it one of its own TTLs after its deadline (node_heartbeat.lua),
    a window a loaded machine's puts and waits can outlast. Its reap time is pushed out by ten
    minutes; a killed agent never beats again to move it back, and liveness is its deadline's."""
    index = client.index
    index.redis.zadd(index.prefix + "reap", {node_id: index.server_time_ms() + 600_000})
    assert wait_until(lambda: _past_deadline(client, node_id), 15.0), f"{node_id} never passed its deadline"
    assert node_id in client.index.nodes(), f"{node_id} was reaped before the step under test"


# ---------------------------------------------------------------------------------------------
def test_put_commit_onto_a_node_past_its_deadline_is_not_reported_stored(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The writer reserves on agent-1 and writes the bytes; agent-1 then dies. Its deadline passes,
    the reaper has not run yet (grace = one TTL), and the writer commits: put_commit.lua only asks
    whether the node left the node table (stale_alloc), not whether it is live, so the put is
    reported stored, and the very next get says KeyNotFound. Nobody removed the key."""
    cluster = make_cluster(2, heartbeat_ttl_s=4.0)
    client = make_client(cluster)
    puts = client._puts
    value = np.full(64 << 10, 0x3C, dtype=np.uint8)
    (plan,) = puts.plan({"late": value}, chain_pos=None, chain_parent=None, preferred_node="agent-1")
    nodes = puts.reserver.reserve([plan], 1, "agent-1")
    assert [r.node_id for r in plan.replicas] == ["agent-1"]
    client.index.put_start([plan.pending()], ttl_ms=60_000)
    for replica in plan.replicas:
        puts.writes.write_replica(nodes[replica.node_id], replica, plan)
    cluster.agent("agent-1").kill()
    _wait_dead_not_reaped(client, "agent-1")
    (status,) = client.index.put_commit([plan.put_id.hex()])
    # Either the commit is refused (the client then places the object on a live node), or what it
    # reports stored can be read.
    assert status != "OK" or client.exists("late"), (
        "put_commit said OK for a replica on a node already past its heartbeat deadline: the put "
        "succeeds and the object is unreadable at once"
    )


# ---------------------------------------------------------------------------------------------
def test_spill_swap_onto_a_peer_past_its_deadline_is_refused(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Agent-0 spills "obj" (its only replica) to agent-1 (reserve, copy), and agent-1 dies before
    the swap. Once agent-1 is past its deadline (but not yet reaped), move_replicas.lua still swaps:
    the object's only listed replica is now on a dead node, agent-0's live copy goes to its
    graveyard, and "obj" is unreadable although the node that held it is alive. (The reaped case
    is refused since review 1: test_spill_swap_to_a_reaped_peer_is_refused.)"""
    cluster = make_cluster(2, heartbeat_ttl_s=4.0)
    client = make_client(cluster)
    a, b = cluster.agents
    old, new, guard = guarded_spill_copy(client, a, b, size=64 << 10)
    b.kill()
    _wait_dead_not_reaped(client, b.node_id)
    (status,) = client.index.move_replicas([("obj", old.alloc_id, new, guard)], old_node=a.node_id)
    assert status != "OK", "the swap moved 'obj' onto a node past its heartbeat deadline"
    assert client.exists("obj")  # its bytes are still on agent-0, which is alive


# ---------------------------------------------------------------------------------------------
def test_eviction_does_not_count_a_replica_on_a_dead_node_as_redundancy(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Chain parent "P" has replicas on agent-0 and agent-1; its child "C" lives on agent-0 only.
    Agent-1 dies (past its deadline, not reaped: held back by the test, _wait_dead_not_reaped).
    Agent-0 comes under pressure: victims.lua lists agent-1 among P's "other nodes", so pressure.py
    does not treat P as a last replica and evict.lua keeps agent-1's dead replica as the one that
    remains. P's last readable copy is evicted while C hangs off it: the chain has a gap (C is
    stored but unreachable by match), which README's "only chunks no stored chunk hangs off,
    unless another node holds a replica" forbids; stats.evictions does not count it either."""
    cluster = make_cluster(0, host_bytes=16 * MiB)
    cluster.add_agent(node_id="agent-0", extra_args=["--heartbeat-ttl-s", "60", "--no-spill"])
    cluster.add_agent(node_id="agent-1", extra_args=["--heartbeat-ttl-s", "2"])
    client = make_client(cluster)
    reader = make_client(cluster, lease_ms=120_000)
    client.put_many({"P": np.full(4 * MiB, 1, np.uint8)}, replicas=2, chain_pos={"P": 0})
    meta = client.object_meta("P")
    assert meta is not None and {r.node_id for r in meta.replicas} == {"agent-0", "agent-1"}
    time.sleep(0.05)  # C is warmer than P
    client.put_many(
        {"C": np.full(MiB, 2, np.uint8)}, preferred_node="agent-0", chain_pos={"C": 1}, chain_parent={"C": "P"}
    )
    reader.get("C")  # a live read lease: C itself is not movable
    cluster.agent("agent-1").kill()
    _wait_dead_not_reaped(client, "agent-1")
    assert client.exists("P")  # readable from agent-0
    # Push agent-0 past its high watermark (0.9 of 16 MiB) with warmer, movable objects.
    fillers = [f"fill/{i}" for i in range(10)]
    for key in fillers:
        client.put(key, np.full(MiB, 3, np.uint8), preferred_node="agent-0")
    assert wait_until(lambda: not client.exists("P") or any(not client.exists(k) for k in fillers), 15.0), (
        "agent-0 never relieved its pressure"
    )
    time.sleep(1.0)  # let the pass finish
    assert "agent-1" in client.index.nodes()  # still not reaped: what follows is eviction's doing
    assert client.exists("C")
    assert client.exists("P"), (
        "agent-0 evicted the last live replica of chain parent 'P' while 'C' hangs off it, "
        "counting the replica on dead agent-1 as another copy"
    )


# ---------------------------------------------------------------------------------------------
def _on_another_host(agent: Agent) -> None:
    """This agent publishes the topology of another machine (its host label and host id): a real
    Agent, placed on a host of its own as `mooncake agent` on a second machine would be."""
    own = agent.node_info
    agent.node_info = lambda: dataclasses.replace(own(), host="host-b", host_id="host-b/boot-b")  # type: ignore[method-assign]


def test_two_replicas_are_not_placed_on_one_host_when_another_host_exists(
    make_inproc_agent: Callable[..., Agent], redis_url: str, namespace: str
) -> None:
    """Two agents on this host (one per GPU or NUMA node, as README describes) and one on another
    host. A put with replicas=2 from this host ranks same-host nodes first (policy/placement.py
    rank_nodes) and choose_replica_nodes takes the first two: both replicas on this host, so one
    host failure loses the object while a node of another host had room."""
    common = {"namespace": namespace, "host_bytes": 8 * MiB, "sync_interval_s": 0.2, "reserve_timeout_s": 30.0}
    a0 = make_inproc_agent(node_id="h1-a0", **common)
    a1 = make_inproc_agent(node_id="h1-a1", **common)
    b0 = make_inproc_agent(node_id="h2-b0", prepare=_on_another_host, **common)
    client = connect(redis_url, namespace=namespace)
    try:
        _check_hosts(client, a0, a1, b0)
    finally:
        client.close()


def _check_hosts(client: Client, a0: Agent, a1: Agent, b0: Agent) -> None:
    hosts = {n.node_id: n.host_id for n in client.index.nodes().values()}
    assert hosts[b0.node_id] != hosts[a0.node_id] == hosts[a1.node_id]
    keys = [f"r2/{i}" for i in range(4)]
    for key in keys:
        client.put(key, np.full(64 << 10, 9, np.uint8), replicas=2)
    for key in keys:
        meta = client.object_meta(key)
        assert meta is not None and len(meta.replicas) == 2
        placed = {hosts[r.node_id] for r in meta.replicas}
        assert len(placed) == 2, (
            f"{key!r}: both replicas on one host ({sorted(r.node_id for r in meta.replicas)}) "
            f"although {b0.node_id} on another host had room"
        )


# ---------------------------------------------------------------------------------------------
def test_prefix_load_ends_the_hit_at_a_chunk_whose_node_just_died(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Chunks 0-3 on agent-0, chunks 4-7 on agent-1; agent-1 is SIGKILLed and a reader on another
    host (TCP only) loads the prefix before agent-1's deadline passes. PrefixCache.load promises
    "A chunk that cannot be read after all (its node died in between) ends the hit there", but
    the get_many path (no outs) lets the TransferError out: the caller gets an exception instead
    of the 4 readable chunks."""
    cluster = make_cluster(2, heartbeat_ttl_s=30.0)
    writer = make_client(cluster)
    cache = PrefixCache(writer, "review5/f32/L2/kv2/d16/tp0", chunk_tokens=16)
    tokens = np.arange(8 * 16, dtype=np.int64)
    rng = np.random.default_rng(0)
    chunks = [rng.standard_normal((2, 16, 64)).astype(np.float32) for _ in range(8)]
    assert cache.store(tokens[: 4 * 16], chunks[:4], preferred_node="agent-0") == 4
    assert cache.store(tokens, chunks, preferred_node="agent-1") == 4
    reader = make_client(cluster, transports=("tcp",), timeout_s=2.0)
    remote = PrefixCache(reader, "review5/f32/L2/kv2/d16/tp0", chunk_tokens=16)
    try:
        assert remote.match(tokens) == 8 * 16
        cluster.agent("agent-1").kill()
        assert remote.match(tokens) == 8 * 16  # still within agent-1's deadline
        with remote.load(tokens) as hit:
            assert hit.num_chunks == 4
            for got, want in zip(hit.chunks, chunks[:4], strict=True):
                assert np.array_equal(got, want)
    finally:
        remote.close()
        cache.close()


# ---------------------------------------------------------------------------------------------
def test_a_batch_read_pays_a_stalled_replica_once_not_once_per_key(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Eight replicas=2 objects; the node listed first for all of them is SIGSTOPped (a stall still
    within its heartbeat TTL, so lookups still return it). A TCP reader's get_many waits one
    timeout on the pipelined train, then _read_object tries the stalled node first again for every
    key, one more timeout each, before failing over to the healthy replica: 9 timeouts for one
    batch. A failover should not ask a node that just timed out again for each key of the batch."""
    cluster = make_cluster(2, heartbeat_ttl_s=60.0)
    writer = make_client(cluster)
    values = {f"b/{i}": np.full(32 << 10, i, np.uint8) for i in range(8)}
    writer.put_many(values, replicas=2)
    firsts = {writer.object_meta(k).replicas[0].node_id for k in values}  # type: ignore[union-attr]
    assert len(firsts) == 1
    stalled: AgentProcess = cluster.agent(firsts.pop())
    timeout_s = 1.0
    reader = make_client(cluster, transports=("tcp",), timeout_s=timeout_s)
    # Count the requests that go to the stalled agent (a spy that calls through): each one waits a
    # whole timeout. Counted rather than timed: timing belongs in benchmarks/.
    peer = reader._tcp.peer(stalled.endpoint)
    asked = count_read_requests(peer)
    stop_process(stalled.pid)  # every thread stopped: none answers a request sent from here on
    try:
        got = reader.get_many(list(values))
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    assert all(np.array_equal(g, v) for g, v in zip(got, values.values(), strict=True))
    # The stalled node was asked (it is listed first: order_replicas keeps that order on a tie), else
    # the bound below holds without a stall ever met.
    assert asked, "the stalled agent was never asked: the case under test never happened"
    # The pipelined train, and at most one single read: not one more timeout per key.
    assert len(asked) <= 2, f"the stalled agent was asked {len(asked)} times for a batch of {len(values)} keys"
