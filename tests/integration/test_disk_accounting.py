"""The disk tier as the agent serves and reports it: a READ's range is checked before the chunk
file is decoded, and `stat` shows the blocks the files take and the ratio of their compressed bytes.

A real in-process agent with a disk tier in a temporary directory, the session's real Redis, a real
TCP transport sending READ frames; the pressure loop is idle, and the test demotes the object as a
pressure pass would."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import counter

from mooncake_store import connect
from mooncake_store.agent.node import Agent
from mooncake_store.errors import StaleLocation
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import TierKind

MiB = 1 << 20
SIZE = 16 * MiB


def disk_object(agent: Agent, key: str, value: np.ndarray) -> int:
    """``value`` stored under ``key`` on ``agent`` and demoted to its disk tier; the disk alloc id."""
    client = connect(agent.index.url, namespace=agent.namespace)
    try:
        client.put(key, value, preferred_node=agent.node_id)
    finally:
        client.close()
    agent.sync_once()
    (victim,) = [c for c in agent.index.victim_candidates(agent.node_id, "host") if c.key == key]
    location = agent.table.offset_of(victim.alloc_id)
    assert location is not None and agent.pressure.moves.demote_to_disk(victim, location[0])
    meta = agent.index.lookup([key], lease_ms=0).objects[0]
    assert meta is not None and meta.replicas[0].tier == TierKind.DISK
    return meta.replicas[0].alloc_id


@pytest.mark.parametrize(
    ("offset", "length"),
    [(SIZE, 1), (SIZE - 1, 2), (1 << 40, 1), (0, SIZE + 1)],
    ids=["at-end", "across", "far", "from-start-past-end"],
)
def test_a_read_outside_a_disk_object_is_refused_before_the_file_is_decoded(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, offset: int, length: int
) -> None:
    """The agent decoded the whole chunk file (16 MiB here, and its checksum) and only then found
    the range outside the object: every such READ cost a full decode, which anyone reaching the port
    could repeat. Now it is refused (STALE) with the file untouched. (The decodes are recorded where
    the file is read: the disk tier's read counter counts one per object, at a READ from its first
    byte, so it would miss a decode for most of these.)"""
    agent = make_inproc_agent(host_bytes=32 * MiB, disk_path=str(tmp_path), disk_bytes=64 * MiB, prepare=idle)
    value = np.arange(SIZE, dtype=np.uint8)
    disk_id = disk_object(agent, "big", value)
    assert agent.disk is not None
    decoded: list[int] = []
    real_read_into = agent.disk.read_into

    def recorded(alloc_id: int, dest: memoryview) -> int:
        decoded.append(alloc_id)
        return real_read_into(alloc_id, dest)

    agent.disk.read_into = recorded  # type: ignore[method-assign]
    transport = TcpTransport(timeout_s=5.0, connections_per_peer=1, stripe_bytes=1 << 62)
    try:
        with pytest.raises(StaleLocation):
            transport.read_into(agent.server.endpoint, disk_id, offset, memoryview(bytearray(length)))
        assert not decoded, "the chunk file was decoded for a READ outside it"
        assert counter(agent, TierKind.DISK, "reads") == 0
        # A READ inside it is served: decoded, and counted once it starts at the object's first byte.
        last = bytearray(1)
        transport.read_into(agent.server.endpoint, disk_id, SIZE - 1, memoryview(last))
        assert last[0] == value[-1] and decoded == [disk_id] and counter(agent, TierKind.DISK, "reads") == 0
        first = bytearray(1)
        transport.read_into(agent.server.endpoint, disk_id, 0, memoryview(first))
        assert first[0] == value[0] and counter(agent, TierKind.DISK, "reads") == 1
    finally:
        transport.close()


def test_stat_shows_the_blocks_files_take_and_the_ratio_of_their_compressed_bytes(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """Once capacity counted whole blocks, stat's compression ratio (raw over used bytes) fell to
    raw over blocks: 2.5 for 10 KiB of zeros that compress to ~50 B each, not ~200."""
    agent = make_inproc_agent(host_bytes=32 * MiB, disk_path=str(tmp_path), disk_bytes=64 * MiB, prepare=idle)
    raw = 10 << 10
    for i in range(8):
        disk_object(agent, f"z{i}", np.zeros(raw, np.uint8))
    assert agent.disk is not None
    stored = agent.disk.stored_bytes
    agent.index.heartbeat(agent.node_id, incarnation=agent.incarnation, ttl_ms=agent._ttl_ms, tiers=agent.tiers())
    client = connect(agent.index.url, namespace=agent.namespace)
    try:
        (node,) = client.stat().nodes
    finally:
        client.close()
    disk = next(t for t in node.tiers if t.tier == "disk")
    assert disk.used_bytes == 8 * agent.disk.block_bytes
    assert disk.compression_ratio == round(8 * raw / stored, 3) > 100


def idle(agent: Agent) -> None:
    """No pressure pass of its own: the test demotes the object itself."""
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


@pytest.mark.parametrize("peer_blocks", [1, 4], ids=["same-blocks", "peer-blocks-4x"])
def test_a_spill_of_small_chunk_files_is_planned_by_the_blocks_they_take_on_the_peer(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, peer_blocks: int
) -> None:
    """The pass planned a peer's disk room by the files' lengths (~100 B each) while the peer's
    inbox counts whole blocks, all or nothing per batch: a peer with room for three files was
    planned for all the pass moved, refused the batch whole, and every file was evicted instead.
    Planned by blocks, the peer gets what it has room for and the rest goes elsewhere. A peer whose
    filesystem has larger blocks (4x here) publishes its block size: planned in this node's blocks,
    its batch was refused whole again."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    block = DiskTier.block_size_of(tmp_path)
    peer_block = peer_blocks * block

    def larger_blocks(agent: Agent) -> None:
        idle(agent)
        assert agent.disk is not None
        agent.disk.block_bytes = peer_block  # what a filesystem of larger blocks reports

    files = 20
    settings: dict[str, Any] = {"namespace": namespace, "host_bytes": 32 * MiB, "spill_to_peers": True}
    a = make_inproc_agent(disk_path=str(tmp_path / "a"), disk_bytes=files * block, prepare=idle, **settings)
    b = make_inproc_agent(disk_path=str(tmp_path / "b"), disk_bytes=4 * peer_block, prepare=larger_blocks, **settings)
    keys = [f"tiny{i:02d}" for i in range(files)]
    for key in keys:
        disk_object(a, key, np.full(64, len(key), np.uint8))
    assert a.disk is not None and a.disk.used_bytes == files * block  # past its high watermark
    a.pressure.relieve_disk()
    metas = [a.index.lookup([k], lease_ms=0).objects[0] for k in keys]
    on_b = [m.key for m in metas if m and (m.replicas[0].node_id, m.replicas[0].tier) == (b.node_id, "disk")]
    room = int(b.config.high_watermark * 4 * peer_block) // peer_block  # whole files under b's high watermark
    assert 1 <= len(on_b) <= room, f"{len(on_b)} of a's files landed on b's disk, which has room for {room}"
    assert b.disk is not None and b.disk.objects == len(on_b) and b.disk.used_bytes == len(on_b) * peer_block
    # The rest went to b's empty host tier, decoded, rather than being evicted (none is lost).
    assert all(m is not None for m in metas)
    assert any(m is not None and m.replicas[0].tier == "host" for m in metas)


def test_repairs_plan_a_peer_s_host_and_disk_tiers_apart(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """The repairs' plan counted what it sent a node in one sum for all its tiers: host copies
    planned onto a peer's host tier left its empty disk tier looking full, and the chunk files
    that were to go there waited for a later call."""
    from mooncake_store.index.pressure import RepairCandidate
    from mooncake_store.types import NodeInfo, TierUsage, TransportKind

    a = make_inproc_agent(host_bytes=32 * MiB, disk_path=str(tmp_path), disk_bytes=64 * MiB, prepare=idle)
    block = a.disk.block_bytes if a.disk is not None else 4096
    host_values = {f"h{i}": np.full(MiB, i, np.uint8) for i in range(6)}
    client = connect(a.index.url, namespace=a.namespace)
    try:
        client.put_many(host_values, preferred_node=a.node_id)
    finally:
        client.close()
    a.sync_once()
    disk_ids = {key: disk_object(a, key, np.full(64, 7, np.uint8)) for key in ("d0", "d1")}
    host_ids = {c.key: c.alloc_id for c in a.index.victim_candidates(a.node_id, "host") if c.key in host_values}
    held = (a.node_id,)
    candidates = [
        RepairCandidate(key=k, size_bytes=MiB, alloc_id=host_ids[k], tier=TierKind.HOST, missing=1, holders=held)
        for k in host_values
    ] + [
        RepairCandidate(key=k, size_bytes=64, alloc_id=d, tier=TierKind.DISK, missing=1, holders=held)
        for k, d in disk_ids.items()
    ]
    now_ms = a.index.server_time_ms()
    peer = NodeInfo(
        node_id="roomy",
        host="h",
        host_id="other-host",
        zone=a.config.zone,
        pid=1,
        tcp_endpoint="127.0.0.1:1",
        shm_name="s",
        transports=(TransportKind.TCP,),
        tiers=(
            TierUsage(tier=TierKind.HOST, capacity_bytes=8 * MiB, used_bytes=0),  # room for six of 1 MiB
            TierUsage(tier=TierKind.DISK, capacity_bytes=8 * block, used_bytes=0),
        ),
        heartbeat_deadline_ms=now_ms + 60_000,
    )
    plan = a.pressure.repairs._plan(candidates, [peer], set(), now_ms=now_ms)
    # Keyed (node, its tier, the tier here): each tier's copies stay in their own tier.
    assert sorted(j.victim.key for j in plan.get(("roomy", TierKind.HOST, TierKind.HOST), [])) == sorted(host_values)
    assert sorted(j.victim.key for j in plan.get(("roomy", TierKind.DISK, TierKind.DISK), [])) == ["d0", "d1"]
    assert len(plan) == 2, sorted(plan)
