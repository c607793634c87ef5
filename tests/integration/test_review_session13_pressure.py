"""Review session 13 (pressure): a demotion that fails sends its victim to a peer before it is
evicted; a peer that stops answering is not asked again pass after pass. Real agents in this
process (their passes run when a test calls them), a real server, real disk files and sockets.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import NEED, SilentPeer, counter, fill, register_silent_node

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

MiB = 1 << 20


def test_a_victim_whose_demotion_fails_spills_to_a_peer_instead_of_being_evicted(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, tmp_path: Path
) -> None:
    """A pass chooses to demote while the tier below has room; when the demotion then fails (the
    disk's writes fail, or the room below was in pieces), the victim was evicted, often its last
    copy, while a peer had room. It is now placed again without the tier below. The disk's
    writes fail for real here: a directory stands where each chunk file's temp file goes."""
    a = direct_agent(namespace, disk_path=str(tmp_path), disk_bytes=64 * MiB, spill_to_peers=True, spill_shm=False)
    b = direct_agent(namespace, host_bytes=32 * MiB)
    client = client_of(namespace)
    values = fill(client, a, "dem")
    assert a.disk is not None
    # The ids the demotions take come next from the agent's id counter.
    after = next(a.table.ids)
    for alloc_id in range(after + 1, after + 64):
        a.disk.path_of(alloc_id).with_suffix(".tmp").mkdir(parents=True, exist_ok=True)
    a.pressure.relieve_host()
    b.sync_once()
    evicted = counter(a, TierKind.HOST, "evictions")
    spilled = counter(a, TierKind.HOST, "spills_out")
    assert (evicted, spilled) == (0, NEED), f"{evicted} evicted and {spilled} spilled, with {b.node_id} empty"
    assert counter(a, TierKind.HOST, "demotions") == 0
    for key, value in values.items():
        assert np.array_equal(client.get(key), value), key


def test_a_peer_that_stops_answering_is_not_asked_again_in_the_next_passes(
    direct_agent: Callable[..., Agent],
    client_of: Callable[[str], Client],
    namespace: str,
    silent_peer: SilentPeer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer that heartbeats but does not answer looks the emptiest (it takes nothing), so every
    pass chose it first and waited out the spill's timeout on its RESERVE before placing the
    victims elsewhere: relief took one step per timeout, and writers waiting for room timed out.
    Once a peer's RESERVE times out it is left out for a heartbeat TTL. (The spill's timeout is
    set to 1 s in this process, so that the test does not wait 30 s.)"""
    from mooncake_store.agent import spill_jobs

    monkeypatch.setattr(spill_jobs, "TIMEOUT_S", 1.0)
    a = direct_agent(namespace, spill_to_peers=True, spill_shm=False)
    b = direct_agent(namespace, host_bytes=16 * MiB)
    client = client_of(namespace)
    register_silent_node(b, silent_peer)  # B's record with the silent endpoint and far more room
    values = fill(client, a, "gh")
    a.pressure.relieve_host()  # asks the ghost first, times out, spills to B
    assert len(silent_peer.accepted) == 1
    assert counter(a, TierKind.HOST, "spills_out") == NEED
    values.update(fill(client, a, "gh2", n=NEED))  # past the high watermark again
    a.pressure.relieve_host()
    assert len(silent_peer.accepted) == 1, "the next pass asked the silent peer again"
    b.sync_once()
    assert counter(a, TierKind.HOST, "spills_out") == 2 * NEED
    for key, value in values.items():
        assert np.array_equal(client.get(key), value), key
