"""A peer that refuses a pass's spills into one of its tiers still takes them into another (a probe
of 2026-12-07): a node under pressure planned its victims into its peer's host tier by a node
table a heartbeat old, the peer had filled since and refused them, and the pass then left that
peer out altogether, its disk tier too, and evicted the victims while the peer's disk was nearly
empty. Only a peer that did not answer (a timeout, a reset) is left out whole for the pass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20


def test_victims_a_peers_full_host_tier_refused_go_to_its_disk_tier(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, tmp_path: Path
) -> None:
    # In-process agents whose heartbeats, syncs and passes run only when called here.
    pressed = direct_agent(namespace, node_id="n0-pressed", host_bytes=4 * MiB, spill_to_peers=True)
    peer = direct_agent(
        namespace, node_id="n1-peer", host_bytes=4 * MiB, disk_path=str(tmp_path), disk_bytes=64 * MiB,
        spill_to_peers=True,
    )  # fmt: skip
    client = client_of(namespace)
    chunk = 256 * KiB

    # The peer's host tier fills without a heartbeat after: its row still says empty.
    for i in range(15):  # 3.75 of 4 MiB, past its high watermark: it takes no spill there
        client.put(f"fill{i}", np.full(chunk, 200, np.uint8), preferred_node=peer.node_id)
    keys = [f"k{i}" for i in range(15)]
    for i, key in enumerate(keys):  # 3.75 MiB on the pressed node, past its 3.6 MiB mark
        client.put(
            key, np.random.default_rng(i).integers(0, 256, chunk, dtype=np.uint8), preferred_node=pressed.node_id
        )
    for agent in (pressed, peer):
        agent.sync_once()  # the commits acked (the syncs run only when called here)
    pressed.heartbeat_once()
    assert peer.index.nodes()[peer.node_id].tier(TierKind.HOST).used_bytes < MiB  # the stale row

    assert pressed.pressure.relieve_host() > 0
    counted = pressed.pressure.counters[TierKind.HOST]
    assert counted["evictions"] == 0, counted
    assert counted["spills_out"] >= 1, counted
    on_disk = []
    for i, key in enumerate(keys):  # every object reads back whole, the spilled ones from the peer's disk
        meta = client.object_meta(key)
        assert meta is not None and len(meta.replicas) == 1, key
        (replica,) = meta.replicas
        if replica.node_id == peer.node_id:
            assert replica.tier == TierKind.DISK, replica
            on_disk.append(key)
        assert np.array_equal(client.get(key), np.random.default_rng(i).integers(0, 256, chunk, dtype=np.uint8))
    assert on_disk, "nothing went to the peer's disk tier"
