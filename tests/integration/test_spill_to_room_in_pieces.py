"""A pressure pass whose only peer with room has it in pieces smaller than the victims asks that
peer anyway, last, and waits for its compaction rather than evicting (a probe of 2026-12-07):
placement passed such a peer over, no RESERVE reached it, so it never compacted, and the pass
evicted a victim while the peer had the room free; a put straight to that peer was stored at once.
The wait is bounded: a peer that makes no block within PIECES_WAIT_S no longer holds victims back."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers import assert_all_read_back

from mooncake_store import Client
from mooncake_store.agent import pressure
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20


def _two_nodes(
    direct_agent: Callable[..., Agent], client: Client, namespace: str, size: int = MiB
) -> tuple[Agent, Agent, dict[str, np.ndarray]]:
    """A node past its high watermark with 4 MiB in objects of ``size``, and a peer with 2.25 MiB
    free in pieces of 256 KiB (512 KiB at its end): no piece holds a 1 MiB victim, one holds a
    512 KiB one. Returns (full, pieces, the values)."""
    full = direct_agent(namespace, node_id="n0-full", spill_to_peers=True)
    pieces = direct_agent(namespace, node_id="n1-pieces", spill_to_peers=True)
    values = {f"fill{i}": np.full(256 * KiB, i, np.uint8) for i in range(15)}
    for key, value in values.items():
        client.put(key, value, preferred_node=pieces.node_id)
    for key in list(values)[::2]:
        client.remove(key)
        del values[key]
    big = {f"big{i}": np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(4 * MiB // size)}
    for key, value in big.items():  # 4 MiB: past its 3.6 MiB mark
        client.put(key, value, preferred_node=full.node_id)
    for agent in (full, pieces):
        agent.sync_once()
        agent.heartbeat_once()
    assert pieces.table.room() == (9 * 256 * KiB, 512 * KiB)
    return full, pieces, {**values, **big}


def test_a_peer_with_its_room_in_pieces_is_waited_for_not_evicted_to(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    client = client_of(namespace)
    full, pieces, values = _two_nodes(direct_agent, client, namespace)
    counted = full.pressure.counters[TierKind.HOST]

    # The first pass asks the peer, which refuses (no block) and wants one: nothing is evicted.
    assert full.pressure.relieve_host() == 0
    assert counted["evictions"] == 0, counted
    assert pieces.pressure.compactor.pending()
    # The peer's compaction makes the block; the next pass spills into it.
    assert pieces.pressure.compactor.run_once() >= 1
    pieces.heartbeat_once()
    assert full.pressure.relieve_host() >= MiB
    assert counted["evictions"] == 0, counted
    assert counted["spills_out"] >= 1, counted
    assert_all_read_back(client, values)


def test_a_peer_that_makes_no_block_holds_victims_back_only_a_while(
    direct_agent: Callable[..., Agent],
    client_of: Callable[[str], Client],
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pressure, "PIECES_WAIT_S", 0.3)
    client = client_of(namespace)
    full, _, values = _two_nodes(direct_agent, client, namespace)
    counted = full.pressure.counters[TierKind.HOST]
    assert full.pressure.relieve_host() == 0
    assert counted["evictions"] == 0, counted
    time.sleep(0.4)  # the peer never compacts (its pressure loop does not run here)
    assert full.pressure.relieve_host() >= MiB
    assert counted["evictions"] >= 1, counted
    gone = [key for key in values if not client.exists(key)]
    assert len(gone) == counted["evictions"] and all(key.startswith("big") for key in gone), gone
    assert_all_read_back(client, {key: value for key, value in values.items() if key not in gone})


def test_victims_a_peer_had_no_block_for_wait_though_it_took_the_rest_of_their_batch(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """Two 512 KiB victims planned into the peer, one free block of 512 KiB there: the first is
    spilled, the second waits for the compaction rather than being evicted for the room still
    wanted."""
    client = client_of(namespace)
    full, pieces, values = _two_nodes(direct_agent, client, namespace, size=512 * KiB)
    counted = full.pressure.counters[TierKind.HOST]
    assert full.pressure.relieve_host() == 512 * KiB
    assert counted["evictions"] == 0 and counted["spills_out"] == 1, counted
    assert pieces.pressure.compactor.pending()
    assert pieces.pressure.compactor.run_once() >= 1
    pieces.heartbeat_once()
    assert full.pressure.relieve_host() >= 512 * KiB
    assert counted["evictions"] == 0 and counted["spills_out"] >= 2, counted
    assert_all_read_back(client, values)
