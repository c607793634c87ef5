"""A pressure pass that finds no peer with room in the victim's own tier spills it to another tier
of a peer's (a host tier, then a disk tier: FALLBACK_TIERS, as repairs copy) before it evicts it.
A node with a disk tier evicted its chunk files while a disk-less peer's host tier stood empty,
and a node without a disk evicted host objects while a peer's disk had room: objects lost from
the cache while the cluster had room for them. Real in-process agents (their pressure loops idle:
the test runs each pass), the session's real server, real spills over TCP."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from helpers import counter

from mooncake_store import connect
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20


def idle(agent: Agent) -> None:
    """No pressure pass of its own: the test runs them."""
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


def values_of(count: int, size: int) -> dict[str, np.ndarray]:
    return {f"fb{i:02d}": np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)}


def where(agent: Agent, keys: list[str]) -> dict[str, tuple[str, str] | None]:
    """Each key's (node, tier), None for one no longer stored."""
    placed: dict[str, tuple[str, str] | None] = {}
    for key, meta in zip(keys, agent.index.lookup(keys, lease_ms=0).objects, strict=True):
        placed[key] = None if meta is None else (meta.replicas[0].node_id, str(meta.replicas[0].tier))
    return placed


def test_chunk_files_go_to_a_disk_less_peer_s_host_tier_before_they_are_evicted(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    settings: dict[str, Any] = {"namespace": namespace, "spill_to_peers": True, "prepare": idle}
    marks = {"high_watermark": 0.5, "low_watermark": 0.25}
    a = make_inproc_agent(host_bytes=8 * MiB, disk_path=str(tmp_path), disk_bytes=4 * MiB, **marks, **settings)
    b = make_inproc_agent(host_bytes=16 * MiB, **settings)  # no disk tier
    values = values_of(12, 256 * KiB)  # incompressible: 3 MiB of files on a 4 MiB disk, past its mark
    client = connect(a.index.url, namespace=namespace)
    try:
        for key, value in values.items():
            client.put(key, value, preferred_node=a.node_id)
        a.sync_once()
        for victim in a.index.victim_candidates(a.node_id, "host"):
            location = a.table.offset_of(victim.alloc_id)
            assert location is not None and a.pressure.moves.demote_to_disk(victim, location[0])
        assert a.disk is not None and a.disk.used_bytes > a.config.high_watermark * a.disk.capacity_bytes
        b.sync_once()  # b's empty host tier in the node table
        a.pressure.relieve_disk()
        placed = where(a, list(values))
        assert None not in placed.values(), f"evicted with room on {b.node_id}'s host tier: {placed}"
        moved = [k for k, p in placed.items() if p == (b.node_id, "host")]
        assert moved, placed
        assert a.disk.used_bytes <= a.config.high_watermark * a.disk.capacity_bytes
        assert counter(a, TierKind.DISK, "spills_out") == len(moved)
        assert counter(a, TierKind.DISK, "evictions") == 0
        b.sync_once()  # which counts the swaps that landed on it
        assert counter(b, TierKind.HOST, "spills_in") == len(moved)
        for key, value in values.items():
            assert np.array_equal(client.get(key), value), key
    finally:
        client.close()


def test_host_objects_go_to_a_peer_s_disk_tier_before_they_are_evicted(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    settings: dict[str, Any] = {"namespace": namespace, "spill_to_peers": True, "prepare": idle}
    a = make_inproc_agent(host_bytes=4 * MiB, high_watermark=0.5, low_watermark=0.25, **settings)  # no disk tier
    # b's host tier takes none of them (256 KiB is past 90 % of it); its disk has room.
    b = make_inproc_agent(host_bytes=256 * KiB, disk_path=str(tmp_path), disk_bytes=16 * MiB, **settings)
    values = values_of(12, 256 * KiB)  # 3 MiB of a's 4 MiB: past its high watermark
    client = connect(a.index.url, namespace=namespace)
    try:
        for key, value in values.items():
            client.put(key, value, preferred_node=a.node_id)
        a.sync_once()
        b.sync_once()
        a.pressure.relieve_host()
        placed = where(a, list(values))
        assert None not in placed.values(), f"evicted with room on {b.node_id}'s disk tier: {placed}"
        moved = [k for k, p in placed.items() if p == (b.node_id, "disk")]
        assert moved, placed
        used, _, _, _ = a.table.usage()
        assert used <= a.config.high_watermark * a.table.capacity_bytes
        assert counter(a, TierKind.HOST, "spills_out") == len(moved)
        assert counter(a, TierKind.HOST, "evictions") == 0
        assert b.disk is not None and b.disk.objects == len(moved)
        b.sync_once()
        assert counter(b, TierKind.DISK, "spills_in") == len(moved)
        for key, value in values.items():
            assert np.array_equal(client.get(key), value), key
    finally:
        client.close()
