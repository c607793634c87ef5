"""Spilling to a same-host peer through its shared arena (agent/spill.py, ``agent.spill_shm``).

Real Agent objects in this process (real servers, arenas in /dev/shm, index scripts against the
session's real Valkey), all in one namespace so that they spill to one another; their pressure loop
is stubbed out, so each test drives the Spiller itself. The paths under pressure with whole agent
processes run in tests/integration/test_pressure.py, once per path.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
from helpers import host_spill_jobs, put_on, replicas_of, wait_until, write_fenced

from mooncake_store.agent.node import Agent
from mooncake_store.agent.spill import Spiller, SpillJob
from mooncake_store.tiers.host import HostArena
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20
SIZE = 256 * KiB


def filled(agent: Agent, count: int) -> tuple[list[SpillJob], dict[str, np.ndarray]]:
    return host_spill_jobs(agent, count, SIZE, prefix="o")


def test_a_same_host_peer_gets_the_batch_by_memcpy_not_writes(make_peer_agent: Callable[..., Agent]) -> None:
    a = make_peer_agent(host_bytes=4 * MiB)
    b = make_peer_agent(host_bytes=8 * MiB)
    jobs, values = filled(a, 6)
    spiller = Spiller(a, streams=2, batch_bytes=2 * SIZE)  # three batches
    try:
        result = spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    assert sorted(j.victim.key for j in result.moved) == sorted(values) and not result.refused
    assert b.server.counters["writes"] == 0, "the bytes went over TCP, not through the shared arena"
    for key, value in values.items():
        (replica,) = replicas_of(a, key)
        assert replica.node_id == b.node_id
        assert bytes(b.arena.view(replica.offset, SIZE)) == value.tobytes(), key


def test_with_spill_shm_off_a_same_host_peer_gets_writes(make_peer_agent: Callable[..., Agent]) -> None:
    a = make_peer_agent(host_bytes=4 * MiB, spill_shm=False)
    b = make_peer_agent(host_bytes=8 * MiB)
    jobs, values = filled(a, 4)
    spiller = Spiller(a, streams=2)
    try:
        result = spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    assert len(result.moved) == 4
    assert b.server.counters["writes"] == 4
    for key, value in values.items():
        (replica,) = replicas_of(a, key)
        assert bytes(b.arena.view(replica.offset, SIZE)) == value.tobytes(), key


def test_nothing_is_copied_into_an_arena_the_fencing_agent_does_not_own(make_peer_agent: Callable[..., Agent]) -> None:
    """The row read at the start of the pass names the arena to map; if the peer restarted since,
    its reservations live in its new arena. The FENCE reply names the fencing agent's arena (a
    digest), so the stale mapping (here a leftover segment of that name) is never written."""
    a = make_peer_agent(host_bytes=4 * MiB)
    b = make_peer_agent(host_bytes=8 * MiB)
    jobs, values = filled(a, 3)
    leftover = HostArena.create(f"mooncake.test-leftover.{uuid.uuid4().hex[:8]}", 8 * MiB)
    try:
        row = dataclasses.replace(a.index.nodes()[b.node_id], shm_name=leftover.name)
        spiller = Spiller(a, streams=1)
        try:
            result = spiller.spill(row, jobs, tier=TierKind.HOST)
        finally:
            spiller.close()
        assert result.moved == []
        assert not any(bytes(leftover.view(0, 8 * MiB))), "the leftover arena was written"
    finally:
        leftover.close()
    for key, value in values.items():
        (replica,) = replicas_of(a, key)
        assert replica.node_id == a.node_id
        assert bytes(a.arena.view(replica.offset, SIZE)) == value.tobytes()
    b.sync_once()
    assert len(b.table) == 0, "the reservations not copied into were not given back"


def test_a_reservation_freed_while_fenced_is_not_regranted_and_the_copy_is_void(
    make_peer_agent: Callable[..., Agent],
) -> None:
    """The peer frees a fenced reservation (its timeout ran out mid-copy): the block is only doomed
    (no other put gets it while the copy may still land) and UNFENCE says the copy is void."""
    a = make_peer_agent(host_bytes=4 * MiB)
    b = make_peer_agent(host_bytes=4 * MiB, reserve_timeout_s=0.3)
    jobs, _ = filled(a, 1)
    peer_row = a.index.nodes()[b.node_id]
    spiller = Spiller(a, streams=1)
    try:
        reserved = spiller._reserve(peer_row, jobs, TierKind.HOST, TierKind.HOST)
        assert reserved is not None
        (res,) = reserved.reservations
        taken: list[int] = []

        def work(fenced: list[bool]) -> list[bool]:
            assert fenced == [True]
            time.sleep(0.5)
            b.sync_once()  # the reservation timed out: freed, but fenced, so only doomed
            put_on(b, "other", np.full(SIZE, 9, np.uint8), tier=TierKind.HOST)
            taken.extend(r.offset for r in replicas_of(b, "other"))
            return [True]

        peer = spiller.transport.peer(peer_row.tcp_endpoint)
        assert peer.fenced([res.alloc_id], peer_row.shm_name, work) == [False]
        assert taken and taken[0] != res.offset, "a doomed (fenced) block was handed to another put"
    finally:
        spiller.close()


def test_a_peer_that_left_the_table_is_unmapped(make_peer_agent: Callable[..., Agent]) -> None:
    a = make_peer_agent(host_bytes=4 * MiB)
    b = make_peer_agent(host_bytes=8 * MiB)
    jobs, _ = filled(a, 1)
    spiller = Spiller(a, streams=1)
    try:
        assert len(spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST).moved) == 1
        assert list(spiller.arenas.shm._segments) == [b.arena.name]
        spiller.arenas.retain([a.node_info()])  # b is not in the table any more
        assert spiller.arenas.shm._segments == {}
    finally:
        spiller.close()


def test_a_client_unmaps_the_arena_of_an_agent_that_left(make_peer_agent: Callable[..., Agent]) -> None:
    """A long-lived client that read from an agent's shared arena keeps that arena allocated while
    it stays mapped: once the node table no longer lists the agent, the mapping goes."""
    from mooncake_store import connect

    a = make_peer_agent(host_bytes=4 * MiB)
    b = make_peer_agent(host_bytes=4 * MiB)
    client = connect(a.index.url, namespace=a.namespace, transports=("shm",))
    try:
        client.put("k", np.arange(SIZE, dtype=np.uint8), preferred_node=b.node_id)
        assert np.array_equal(client.get("k"), np.arange(SIZE, dtype=np.uint8))
        assert b.arena.name in client._shm._segments
        b.stop()
        client._node_table(refresh=True)
        assert b.arena.name not in client._shm._segments
    finally:
        client.close()


def test_an_agent_under_pressure_maps_its_same_host_peers_before_it_spills(
    make_peer_agent: Callable[..., Agent],
) -> None:
    """Mapping a peer's arena (page tables populated) costs ~0.1 s per GiB: an agent past its high
    watermark maps its same-host peers in the background while its passes still find nothing to
    move, so the first batch does not wait for it; an agent under no pressure maps nothing."""
    a = make_peer_agent(
        host_bytes=4 * MiB, real_pressure=True, pressure_interval_s=0.02, high_watermark=0.5, low_watermark=0.25
    )
    b = make_peer_agent(host_bytes=8 * MiB)
    spiller = a.pressure._spiller
    time.sleep(0.2)
    assert not spiller.arenas.shm.mapped(b.arena.name), "mapped with no pressure"
    far = a.index.server_time_ms() + 600_000
    keys = [f"pinned-{i}" for i in range(3)]
    for key in keys:  # pinned first (a pin may name a key before it exists): nothing can move
        a.index.redis.zadd(a.index.prefix + "pins:" + key, {"test": far})
    for i, key in enumerate(keys):
        put_on(a, key, np.full(MiB, i, np.uint8), tier=TierKind.HOST)
    assert wait_until(lambda: spiller.arenas.shm.mapped(b.arena.name), 10), "the same-host peer was not mapped"
    assert len(b.table) == 0  # nothing was spilled: the mapping came first


def test_a_same_host_put_never_writes_into_a_block_its_agent_gave_away(
    make_peer_agent: Callable[..., Agent],
) -> None:
    """A client's same-host put copies into the agent's shared arena under the agent's fence, as
    a spill does: when the client stalled past the reservation timeout and the agent gave the block
    to another put, the late copy is not made (ReservationExpired: the put is placed again) and the
    other object keeps its bytes."""
    from mooncake_store import connect
    from mooncake_store.errors import ReservationExpired

    agent = make_peer_agent(host_bytes=4 * MiB, reserve_timeout_s=0.3)
    client = connect(agent.index.url, namespace=agent.namespace, transports=("shm", "tcp"))
    try:
        puts = client._puts
        (plan,) = puts.plan({"late": np.full(SIZE, 0x5A, np.uint8)}, chain_pos=None, chain_parent=None)
        nodes = puts.reserver.reserve([plan], 1, None)
        (replica,) = plan.replicas
        time.sleep(0.5)  # the writer stalls past the agent's reservation timeout
        agent.sync_once()  # never committed: the agent frees the reservation
        other = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
        put_on(agent, "other", other, tier=TierKind.HOST)
        (taken,) = replicas_of(agent, "other")
        assert taken.offset == replica.offset, "the allocator did not hand the same block out again"
        with pytest.raises(ReservationExpired):
            write_fenced(puts, nodes[agent.node_id], [(replica, plan)])
        assert bytes(agent.arena.view(taken.offset, SIZE)) == other.tobytes(), "the late copy overwrote it"
    finally:
        client.close()


def test_a_same_host_put_to_an_agent_that_does_not_own_the_named_segment_goes_over_tcp(
    make_peer_agent: Callable[..., Agent],
) -> None:
    """The node row names a segment the agent does not own (here a leftover of that name): the
    FENCE reply's arena digest differs, nothing is copied into the leftover, and the bytes go over
    TCP into the agent's own arena instead."""
    from mooncake_store import connect
    from mooncake_store.index.schema import encode_node

    agent = make_peer_agent(host_bytes=4 * MiB)
    leftover = HostArena.create(f"mooncake.test-leftover.{uuid.uuid4().hex[:8]}", 4 * MiB)
    index = agent.index
    index.redis.hset(
        index.prefix + "nodes",
        agent.node_id,
        encode_node(dataclasses.replace(agent.node_info(), shm_name=leftover.name), agent.incarnation),
    )
    writer = connect(index.url, namespace=agent.namespace, transports=("shm", "tcp"))
    reader = connect(index.url, namespace=agent.namespace, transports=("tcp",))
    try:
        value = np.random.default_rng(9).integers(0, 256, SIZE, dtype=np.uint8)
        writer.put("k", value)
        assert not any(bytes(leftover.view(0, 4 * MiB))), "the leftover segment was written"
        assert np.array_equal(reader.get("k"), value)
    finally:
        writer.close()
        reader.close()
        leftover.close()


def test_when_one_stream_breaks_the_others_send_no_more_of_its_batch(
    make_peer_agent: Callable[..., Agent],
) -> None:
    """Two streams write one batch over TCP and the peer cuts one of them early (it stays up): the
    batch is given up whole (nothing swapped, every object still on the sender, byte-exact), so
    the other stream finishes what it has in flight and takes no more of it, rather than sending
    the rest of the batch for nothing; the peer frees the batch's reservations at its next sync."""
    count = 96  # the bound below (half) sits far above what the stop lets through (5-9 of 48)
    a = make_peer_agent(host_bytes=(count + 8) * SIZE, spill_shm=False)  # the TCP path
    b = make_peer_agent(host_bytes=(count + 8) * SIZE)
    jobs, values = filled(a, count)
    real_begin_write = b.table.begin_write
    writes: list[int] = []

    def fifth_write_cuts_its_connection(alloc_id: int, offset: int, length: int) -> bool:
        writes.append(alloc_id)
        if len(writes) == 5:
            raise OSError("connection reset by the test")  # the server closes this connection
        return real_begin_write(alloc_id, offset, length)

    b.table.begin_write = fifth_write_cuts_its_connection  # type: ignore[method-assign]
    spiller = Spiller(a, streams=2, batch_bytes=count * SIZE)  # one batch
    try:
        result = spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    assert result.refused and not result.moved and len(result.unsent) == count
    # The writes after the cut: the other stream's window, and what it took before the broken one
    # noticed (its next reply read ends at once): 5-9 of 48; without the stop it wrote all the rest.
    assert len(writes) < count // 2, f"{len(writes)} of {count} writes reached the peer after one stream broke"
    b.sync_once()
    assert len(b.table) == 0, "a reservation of the given-up batch is still held on the peer"
    for key, value in values.items():
        (replica,) = replicas_of(a, key)
        assert replica.node_id == a.node_id
        assert np.array_equal(np.frombuffer(a.arena.view(replica.offset, SIZE), np.uint8), value), key
