"""A pressure pass whose spills a peer refused walks on to warmer victims before it evicts (a
node-death probe of 2026-12-07): the coldest objects of a node had their other copy on the one
peer with room (a holder is no destination), their planned peer had filled since the node table
was read and refused them, and the pass evicted them at once, though its warmer objects could
spill to that roomy peer. Each lost its second copy; SIGKILL the roomy peer then, and they were
gone, with replicas=2 and the cluster two thirds full."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

KiB = 1 << 10


def test_victims_a_peer_refused_are_kept_while_warmer_ones_can_spill(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    # In-process agents whose heartbeats, syncs and passes run only when called here. Node ids in
    # this order, so that a stale table's tie between the two peers goes to the roomy one.
    pressed = direct_agent(namespace, node_id="n0-pressed", spill_to_peers=True)
    roomy = direct_agent(namespace, node_id="n1-roomy", spill_to_peers=True)
    filled = direct_agent(namespace, node_id="n2-filled", spill_to_peers=True)
    client = client_of(namespace)
    chunk = 256 * KiB

    # The filled peer fills without a heartbeat after: its row still says empty.
    for i in range(15):  # 3.75 of 4 MiB, past its high watermark: it takes no spill
        client.put(f"fill{i}", np.full(chunk, 200, np.uint8), preferred_node=filled.node_id)
    cold = [f"cold{i}" for i in range(4)]
    for i, key in enumerate(cold):  # the pressed node's coldest, their other copies on the roomy peer
        client.put(key, np.full(chunk, i, np.uint8), replicas=2, preferred_node=pressed.node_id)
        meta = client.object_meta(key)
        assert meta is not None and {r.node_id for r in meta.replicas} == {pressed.node_id, roomy.node_id}
    warm = [f"warm{i}" for i in range(11)]
    for i, key in enumerate(warm):  # 3.75 MiB in all on the pressed node, past its 3.6 MiB mark
        client.put(key, np.full(chunk, 100 + i, np.uint8), preferred_node=pressed.node_id)
    for agent in (pressed, roomy, filled):
        agent.sync_once()  # the commits acked (the syncs run only when called here)
    for agent in (pressed, roomy):
        agent.heartbeat_once()

    assert pressed.pressure.relieve_host() > 0
    counted = pressed.pressure.counters[TierKind.HOST]
    assert counted["evictions"] == 0, counted
    assert counted["spills_out"] >= 3, counted
    for key in cold:  # each keeps both copies: the filled peer refused them, the roomy one holds them
        meta = client.object_meta(key)
        assert meta is not None and sorted(r.node_id for r in meta.replicas) == [pressed.node_id, roomy.node_id]
    spilled = [key for key in warm if (m := client.object_meta(key)) and m.replicas[0].node_id == roomy.node_id]
    assert spilled, "no warm object went to the roomy peer"
    for i, key in enumerate(warm):  # and every object reads back whole
        assert np.array_equal(client.get(key), np.full(chunk, 100 + i, np.uint8))
    for i, key in enumerate(cold):
        assert np.array_equal(client.get(key), np.full(chunk, i, np.uint8))
