"""An agent reaped while it stalled (not dead: SIGSTOP, a long pause) keeps the memory of the
objects the purge took from the index until the read leases granted on them end. It freed all of it
at once when it came back, and a new put reused a block that a same-host reader, whose lease still
ran, was about to copy from the shared arena: the reader got the newcomer's bytes as the old
object's (the agent never sees shm readers; only their lease protects them).

In-process agents driven step by step, and a real agent process stopped with SIGSTOP, on the
session's real Valkey."""

from __future__ import annotations

import mmap
import os
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers import stop_process, synced_after, wait_until

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.agent.node import Agent

MiB = 1 << 20


def reap(agent: Agent) -> None:
    """The node's deadline long past, and a reaper's purge, as another agent's reaper would do."""
    agent.index.redis.zadd(agent.index.prefix + "hb", {agent.node_id: 1})
    assert agent.node_id in agent.index.reap_dead_nodes(grace_ms=0)


@pytest.mark.parametrize("synced", [True, False], ids=["committed", "commit-not-yet-synced"])
def test_a_reaped_node_holds_its_objects_memory_until_their_read_leases_end(
    make_inproc_agent: Callable[..., Agent], synced: bool
) -> None:
    """``synced``: the agent drained the puts' acks before it stalled (its allocations committed),
    or not (still reservations to it, committed in the index: a sync frees those at once)."""

    def idle(agent: Agent) -> None:  # no pressure pass: the arena's blocks stay where the test puts them
        agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]

    agent = make_inproc_agent(host_bytes=8 * MiB, heartbeat_interval_s=600.0, heartbeat_ttl_s=1200.0, prepare=idle)
    client = connect(agent.index.url, namespace=agent.namespace)
    try:
        client.put("read", np.full(MiB, 0xAA, np.uint8), preferred_node=agent.node_id)
        client.put("unread", np.full(MiB, 0xBB, np.uint8), preferred_node=agent.node_id)
        if synced:
            agent.sync_once()
        lease_ms = 2500
        # Taken before the lookup that starts the lease: the checks below bound the time since the
        # lease began from both sides, and a stamp taken later on a loaded machine moves both.
        leased_at = time.monotonic()
        (read,) = agent.index.lookup(["read"], lease_ms=lease_ms).objects  # a same-host reader's lookup
        (unread,) = agent.index.lookup(["unread"], lease_ms=0).objects
        assert read is not None and unread is not None
        leased, idle = read.replicas[0], unread.replicas[0]
        reap(agent)
        agent.heartbeat_once()  # it wakes: its record is gone, it drops everything and registers again
        assert agent.node_id in agent.index.nodes()
        agent.sync_once()  # a sync before the lease ends
        # The unread object's lease had ended: its memory is free at once. The read one's is held.
        assert agent.table.offset_of(idle.alloc_id) is None
        assert agent.table.offset_of(leased.alloc_id) == (leased.offset, MiB)
        newcomers = {f"new{i}": np.full(MiB, 0x55, np.uint8) for i in range(7)}  # the arena's every other block
        client.put_many(newcomers, preferred_node=agent.node_id)
        offsets = {r.offset for m in agent.index.lookup(list(newcomers), lease_ms=0).objects if m for r in m.replicas}
        assert leased.offset not in offsets, "a newcomer was given the leased object's block"
        assert idle.offset in offsets  # the freed block was taken
        assert bytes(agent.arena.view(leased.offset, MiB)) == b"\xaa" * MiB
        agent.sync_once()
        if time.monotonic() - leased_at < lease_ms / 1000 - 0.5:
            assert agent.table.offset_of(leased.alloc_id) is not None  # a sync before the lease ends keeps it
        # Once the lease has run out, the next sync frees it.
        assert wait_until(lambda: agent.sync_once() or agent.table.offset_of(leased.alloc_id) is None, 10)
        assert time.monotonic() - leased_at >= lease_ms / 1000 - 0.2
        for key, value in newcomers.items():
            assert np.array_equal(client.get(key), value), key
    finally:
        client.close()


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_reaped_node_holds_the_old_copy_a_reader_leased_before_a_remove_or_replace(
    make_inproc_agent: Callable[..., Agent], how: str
) -> None:
    """The object left the index before the reap, its old copy buried in the node's graveyard until
    the reader's lease ends: no object record names it, so the purge must carry the grave over to
    what the agent holds when it comes back (it deleted the graveyard, and the block went to the
    next put while the reader could still copy it)."""

    def idle(agent: Agent) -> None:
        agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]

    agent = make_inproc_agent(host_bytes=8 * MiB, heartbeat_interval_s=600.0, heartbeat_ttl_s=1200.0, prepare=idle)
    client = connect(agent.index.url, namespace=agent.namespace)
    try:
        client.put("read", np.full(MiB, 0xAA, np.uint8), preferred_node=agent.node_id)
        agent.sync_once()
        lease_ms = 8000  # far longer than the steps below take, even on a loaded machine
        (read,) = agent.index.lookup(["read"], lease_ms=lease_ms).objects  # a same-host reader's lookup
        assert read is not None
        leased = read.replicas[0]
        leased_at = time.monotonic()
        if how == "removed":
            assert client.remove("read")
        else:
            client.put("read", np.full(MiB, 0xCC, np.uint8), preferred_node=agent.node_id)
        reap(agent)
        agent.heartbeat_once()  # it wakes: its record is gone, it drops everything and registers again
        agent.sync_once()
        assert agent.table.offset_of(leased.alloc_id) == (leased.offset, MiB), "the leased old copy was freed"
        newcomers = {f"new{i}": np.full(MiB, 0x55, np.uint8) for i in range(6)}
        client.put_many(newcomers, preferred_node=agent.node_id)
        offsets = {r.offset for m in agent.index.lookup(list(newcomers), lease_ms=0).objects if m for r in m.replicas}
        assert time.monotonic() - leased_at < lease_ms / 1000 - 0.5, "too slow to judge: the lease ran out"
        assert leased.offset not in offsets, "a newcomer was given the leased old copy's block"
        assert bytes(agent.arena.view(leased.offset, MiB)) == b"\xaa" * MiB
        # Once the lease has run out, a sync frees it.
        assert wait_until(lambda: agent.sync_once() or agent.table.offset_of(leased.alloc_id) is None, 30)
    finally:
        client.close()


def test_a_stalled_agent_that_comes_back_does_not_hand_out_a_block_a_reader_may_still_copy(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """With a real agent process: a reader looked the object up (a 30 s lease), the agent stalled
    past its 1.5 s TTL and was reaped (by the other agent), then came back; puts after that must not
    get the object's block while the lease runs, and the bytes a same-host reader would copy from
    the segment are still the object's."""
    lease_s = 30.0  # long past what the test takes (reaping alone is 3-4 s), however loaded the machine
    cluster = make_cluster(2, heartbeat_ttl_s=1.5, host_bytes=4 * MiB)  # agent-1 reaps agent-0
    writer = make_client(cluster, timeout_s=10.0)
    writer.put("victim", np.full(MiB, 0xAA, np.uint8), preferred_node="agent-0")
    time.sleep(0.6)  # the agent's syncs commit it (a reservation it holds is freed by other rules)
    (meta,) = writer.index.lookup(["victim"], lease_ms=int(lease_s * 1000)).objects
    assert meta is not None
    replica = meta.replicas[0]
    node = writer.index.nodes()[replica.node_id]
    agent = cluster.agent(replica.node_id)
    looked_up = time.monotonic()
    stop_process(agent.pid)
    try:
        assert wait_until(lambda: replica.node_id not in writer.index.nodes(), 10), "never reaped"
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    assert wait_until(lambda: replica.node_id in writer.index.nodes(), 10), "never registered again"
    # A sync of its own since it came back: whatever it would free is free by now.
    assert wait_until(synced_after(writer, replica.node_id), 10), "the agent never synced again"
    fd = os.open(f"/dev/shm/{node.shm_name}", os.O_RDONLY)
    try:
        segment = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        for i in range(3):  # the arena's other blocks: none of them is the victim's
            writer.put(f"new{i}", np.full(MiB, 0x55, np.uint8), preferred_node="agent-0")
            (new,) = writer.index.lookup([f"new{i}"], lease_ms=0).objects
            assert new is not None and new.replicas[0].offset != replica.offset, f"new{i} took the leased block"
        assert time.monotonic() - looked_up < 0.8 * lease_s, "too slow to judge: the reader's budget ran out"
        assert segment[replica.offset : replica.offset + MiB] == b"\xaa" * MiB
    finally:
        segment.close()
