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
from helpers import put_on, replicas_of

from mooncake_store.agent.node import Agent
from mooncake_store.agent.spill import Spiller, SpillJob
from mooncake_store.types import ALLOC_TAG_SHIFT, TierKind

KiB = 1 << 10
MiB = 1 << 20
SIZE = 256 * KiB


@pytest.fixture
def make_agent(make_inproc_agent: Callable[..., Agent]) -> Callable[..., Agent]:
    namespace = f"t-{uuid.uuid4().hex[:10]}"

    def make(**overrides: object) -> Agent:
        settings: dict[str, object] = {
            "node_id": f"shm-{uuid.uuid4().hex[:6]}",
            "heartbeat_interval_s": 600.0,
            "heartbeat_ttl_s": 1200.0,
            "reserve_timeout_s": 30.0,
            "spill_to_peers": True,
            **overrides,
        }

        def prepare(agent: Agent) -> None:
            agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]

        return make_inproc_agent(namespace=namespace, prepare=prepare, **settings)

    return make


def filled(agent: Agent, count: int) -> tuple[list[SpillJob], dict[str, np.ndarray]]:
    """``count`` distinct objects committed on ``agent``'s host tier, as spill jobs."""
    values = {f"o{i}": np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8) for i in range(count)}
    for key, value in values.items():
        put_on(agent, key, value, tier=TierKind.HOST)
    victims = sorted(agent.index.victim_candidates(agent.node_id, "host"), key=lambda c: c.key)
    jobs = [SpillJob(victim=v, offset=agent.table.offset_of(v.alloc_id)[0]) for v in victims]  # type: ignore[index]
    return jobs, values


def test_a_same_host_peer_gets_the_batch_by_memcpy_not_writes(make_agent: Callable[..., Agent]) -> None:
    a = make_agent(host_bytes=4 * MiB)
    b = make_agent(host_bytes=8 * MiB)
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


def test_with_spill_shm_off_a_same_host_peer_gets_writes(make_agent: Callable[..., Agent]) -> None:
    a = make_agent(host_bytes=4 * MiB, spill_shm=False)
    b = make_agent(host_bytes=8 * MiB)
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


def test_reservations_of_another_incarnation_than_the_row_are_not_copied_into(
    make_agent: Callable[..., Agent],
) -> None:
    """The row names the arena to map; a reservation whose alloc tag is not the row's comes from a
    later incarnation of the peer (another arena): copying into the row's arena would leave the new
    arena's block with stale bytes under a swapped location. The objects stay, the room goes back."""
    a = make_agent(host_bytes=4 * MiB)
    b = make_agent(host_bytes=8 * MiB)
    jobs, values = filled(a, 3)
    row = a.index.nodes()[b.node_id]
    older = dataclasses.replace(row, alloc_tag=(row.alloc_tag % 0xFFFF) + 1)
    spiller = Spiller(a, streams=1)
    try:
        result = spiller.spill(older, jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    assert result.moved == []
    for key, value in values.items():
        (replica,) = replicas_of(a, key)
        assert replica.node_id == a.node_id
        assert bytes(a.arena.view(replica.offset, SIZE)) == value.tobytes()
    b.sync_once()
    assert len(b.table) == 0, "the reservations not copied into were not given back"


def test_a_reservation_older_than_half_the_timeout_is_not_copied_into(make_agent: Callable[..., Agent]) -> None:
    """Without a fence on the peer, a copy goes only into reservations the peer surely still holds."""
    a = make_agent(host_bytes=4 * MiB, reserve_timeout_s=2.0)
    b = make_agent(host_bytes=8 * MiB)
    jobs, _ = filled(a, 2)
    peer = a.index.nodes()[b.node_id]
    spiller = Spiller(a, streams=1)
    try:
        reserved = spiller._reserve(peer, jobs, TierKind.HOST)
        assert reserved is not None
        segment = spiller._peer_segment(peer, TierKind.HOST)
        assert segment is not None
        before = bytes(b.arena.view(reserved.reservations[0].offset, SIZE))
        stale = dataclasses.replace(reserved, at=time.monotonic() - 1.5)
        assert spiller._copy_all(segment, peer, stale) == [False, False]
        assert bytes(b.arena.view(reserved.reservations[0].offset, SIZE)) == before
        fresh = dataclasses.replace(reserved, at=time.monotonic())
        assert spiller._copy_all(segment, peer, fresh) == [True, True]
    finally:
        spiller.close()


def test_a_peer_that_left_the_table_is_unmapped(make_agent: Callable[..., Agent]) -> None:
    a = make_agent(host_bytes=4 * MiB)
    b = make_agent(host_bytes=8 * MiB)
    jobs, _ = filled(a, 1)
    spiller = Spiller(a, streams=1)
    try:
        assert len(spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST).moved) == 1
        assert list(spiller._shm._segments) == [b.arena.name]
        spiller.retain([a.node_info()])  # b is not in the table any more
        assert spiller._shm._segments == {}
    finally:
        spiller.close()


def test_alloc_tags_sit_where_the_check_reads_them() -> None:
    assert ALLOC_TAG_SHIFT == 47  # _copy_all compares alloc_tag_of(reservation) with the row's tag


def test_a_client_unmaps_the_arena_of_an_agent_that_left(make_agent: Callable[..., Agent]) -> None:
    """A long-lived client that read from an agent's shared arena keeps that arena allocated while
    it stays mapped: once the node table no longer lists the agent, the mapping goes."""
    from mooncake_store import connect

    a = make_agent(host_bytes=4 * MiB)
    b = make_agent(host_bytes=4 * MiB)
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
