"""A batch a peer refuses for want of a block, not of bytes, still sends what the peer's largest
free block holds (a replica-durability probe of 2026-12-07): the spiller sized what to send by the
refusal's free bytes alone, all of the batch by that count, and sent none of it. A repair to the
one peer left, 44% full with its room in 1 MiB holes, copied none of three 8 MiB objects at every
try, and they stayed one copy short for good."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

KiB = 1 << 10


def test_a_repair_to_a_peer_with_its_room_in_pieces_copies_what_its_largest_block_holds(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    holder = direct_agent(namespace, node_id="n0-holder", spill_to_peers=True)
    gone = direct_agent(namespace, node_id="n1-gone", spill_to_peers=True)
    pieces = direct_agent(namespace, node_id="n2-pieces", spill_to_peers=True)
    client = client_of(namespace)
    # The peer with room in pieces: 15 x 256 KiB in its 4 MiB, every other one of them removed.
    fill = [f"fill{i}" for i in range(15)]
    for i, key in enumerate(fill):
        client.put(key, np.full(256 * KiB, i, np.uint8), preferred_node=pieces.node_id)
    for key in fill[::2]:
        client.remove(key)
    pieces.sync_once()
    pieces.heartbeat_once()
    free, largest = pieces.table.room()
    assert (free, largest) == (9 * 256 * KiB, 512 * KiB), "the layout this test needs: one 512 KiB block"
    row = client._node_table(refresh=True)[pieces.node_id].tier(TierKind.HOST)
    assert row is not None and row.largest_free_bytes == 512 * KiB  # published: peers plan by it

    big = [f"big{i}" for i in range(3)]
    for i, key in enumerate(big):
        client.put(key, np.full(512 * KiB, 100 + i, np.uint8), replicas=2, preferred_node=holder.node_id)
        meta = client.object_meta(key)
        assert meta is not None and {r.node_id for r in meta.replicas} == {holder.node_id, gone.node_id}
    holder.sync_once()
    gone.sync_once()
    # The second node dies: its copies are purged, and the objects are listed short at the holder.
    client.index.redis.zadd(client.index.prefix + "hb", {gone.node_id: 1})
    assert gone.node_id in client.index.reap_dead_nodes(grace_ms=0)
    assert client.stat().short == 3

    # 1.5 MiB fit the peer's 2.25 MiB free (under its high watermark too), but in one 512 KiB block.
    assert holder.pressure.repairs.run_once(set()) == 1
    assert client.stat().short == 2
    copied = [key for key in big if len(client.object_meta(key).replicas) == 2]  # type: ignore[union-attr]
    assert len(copied) == 1
    for i, key in enumerate(big):
        assert np.array_equal(client.get(key), np.full(512 * KiB, 100 + i, np.uint8))
