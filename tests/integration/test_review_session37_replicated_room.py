"""Room made for a writer whose put keeps replicas on several nodes (thirty-seventh session, found
by a soak): a node asked for room spilled its objects into the peers, where the same put's other
replicas needed room; asked in turn, those spilled them back, and a replicas=3 put on three nodes
whose free room was in pieces waited out timeout_s while the cluster's use stood still. Such a
writer's RESERVE now says so (frames.REPLICATED_FLAG), and the node it asks makes that room by
demotion or eviction, not by spills."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.errors import NoCapacity
from mooncake_store.transport import frames
from mooncake_store.types import TierKind

MiB = 1 << 20


@pytest.mark.parametrize("replicated", [True, False])
def test_a_replicated_writer_gets_its_room_by_eviction_not_by_spills_to_peers(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, replicated: bool
) -> None:
    pressed = direct_agent(namespace, host_bytes=4 * MiB, spill_to_peers=True, high_watermark=0.95)
    peer = direct_agent(namespace, host_bytes=4 * MiB, spill_to_peers=True, high_watermark=0.95)
    client = client_of(namespace)
    for i in range(12):  # 3 MiB of 4, cold, unpinned, never read
        client.put(f"k{i}", np.full(MiB // 4, i, np.uint8), preferred_node=pressed.node_id)
    flags = frames.REPLICATED_FLAG if replicated else 0
    with pytest.raises(NoCapacity):  # 2 MiB do not fit: the writer asks for room
        client._tcp.peer(pressed.server.endpoint).reserve([(2 * MiB, b"w" * 16)], node_id=pressed.node_id, flags=flags)
    pressed.sync_once()  # the commits acked (its syncs run only when called here)
    # Passes as the agent's loop runs them while a writer waits (each sized by what is still
    # missing: the victims freed may lie apart), bounded.
    for _ in range(8):
        if pressed.pressure.relieve_host() == 0 or pressed.table.usage()[2] >= 2 * MiB:
            break
    assert pressed.table.usage()[2] >= 2 * MiB, pressed.table.usage()
    counted = pressed.pressure.counters[TierKind.HOST]
    if replicated:
        assert counted["evictions"] > 0 and counted["spills_out"] == 0, counted
        assert peer.pressure.counters[TierKind.HOST]["spills_in"] == 0
    else:  # a single-replica writer's room is made as before: the cold objects go to the peer
        assert counted["spills_out"] > 0 and counted["evictions"] == 0, counted
