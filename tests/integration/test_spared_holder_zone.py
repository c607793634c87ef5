"""A replicated writer's pass spares the peers of the put's other replicas, and still knows them: a
victim whose other copy sits on a spared peer is spilled to another zone than that copy's. The pass
was built from the peers it may spill to alone, where placement looks a victim's holders up; such a
victim had none, and both copies ended in one zone while a peer in a third zone had room."""

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


@pytest.mark.parametrize("writer", ["single-replica writer", "replicated writer sparing the holder"])
def test_a_spilled_copy_stays_out_of_its_other_copys_zone(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, writer: str
) -> None:
    settings = {"spill_to_peers": True, "high_watermark": 0.95}
    pressed = direct_agent(namespace, node_id="zz-pressed", zone="z1", host_bytes=4 * MiB, **settings)
    holder = direct_agent(namespace, node_id="zz-holder", zone="z2", host_bytes=8 * MiB, **settings)
    client = client_of(namespace)
    for i in range(12):  # 3 MiB of 4, cold: a copy here and one on the holder (zone z2)
        client.put(f"r{i}", np.full(MiB // 4, i, np.uint8), replicas=2, preferred_node=pressed.node_id)
    # Then a roomy peer in the holder's zone, and one with room enough in a zone of its own.
    direct_agent(namespace, node_id="zz-samezone", zone="z2", host_bytes=32 * MiB, **settings)
    direct_agent(namespace, node_id="zz-otherzone", zone="z3", host_bytes=16 * MiB, **settings)
    flags = 0 if writer == "single-replica writer" else frames.replicated_flags([holder.node_id])
    with pytest.raises(NoCapacity):  # 2 MiB do not fit: the writer asks for room
        client._tcp.peer(pressed.server.endpoint).reserve([(2 * MiB, b"w" * 16)], node_id=pressed.node_id, flags=flags)
    pressed.sync_once()
    for _ in range(8):
        if pressed.pressure.relieve_host() == 0 or pressed.table.usage()[2] >= 2 * MiB:
            break
    assert pressed.table.usage()[2] >= 2 * MiB, pressed.table.usage()
    assert pressed.pressure.counters[TierKind.HOST]["spills_out"] > 0, pressed.pressure.counters[TierKind.HOST]
    same_zone = []
    for i in range(12):
        (listing,) = client.index.list_keys(f"r{i}")
        nodes = {r.node_id for r in listing.replicas}
        if {"zz-holder", "zz-samezone"} <= nodes:
            same_zone.append(f"r{i}")
    assert not same_zone, f"both copies of {same_zone} in zone z2, while zz-otherzone (z3) had room ({writer})"
