"""A repair copies into another tier when no peer has room in the tier of its source replica.

A repair copied tier to same tier only: an object whose surviving replica sat in a chunk file, on a
cluster where no other node has a disk tier, stayed short of its replicas for good (the next loss
took it), and so did a host object when the only room left was on peers' disks. Now the copy goes
to a peer's host tier, else its disk tier, in the form that tier keeps: the plain bytes decoded
(and checked) from the chunk file, or a chunk file made from the host bytes, which the peer
decodes and checks before it answers.

Real in-process agents on the session's real Redis, their pressure loops idle: the test reaps the
node that died and calls the holder's repair step as its pressure loop would; the copy's bytes
are read back from the new holder over a real TCP connection."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from helpers import counter

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.tiers.chunk_format import FLAG_SHUFFLED
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import Replica, TierKind

MiB = 1 << 20


def replicas(agent: Agent, key: str) -> list[Replica]:
    meta = agent.index.lookup([key], lease_ms=0).objects[0]
    assert meta is not None, f"{key} is gone"
    return list(meta.replicas)


def demote_all(agent: Agent, keys: list[str]) -> None:
    """Each of ``keys``'s replicas on ``agent`` into its disk tier, as a pressure pass would."""
    agent.sync_once()
    for victim in agent.index.victim_candidates(agent.node_id, "host"):
        if victim.key in keys:
            location = agent.table.offset_of(victim.alloc_id)
            assert location is not None and agent.pressure.moves.demote_to_disk(victim, location[0])


def reap(survivor: Agent, dead: Agent) -> None:
    survivor.index.redis.zadd(survivor.index.prefix + "hb", {dead.node_id: 1})  # its deadline long past
    assert dead.node_id in survivor.index.reap_dead_nodes(grace_ms=0)


def read_back(holder: Agent, replica: Replica) -> np.ndarray:
    """The bytes of ``replica`` as ``holder`` serves them over TCP (a chunk file decoded there)."""
    out = bytearray(replica.size_bytes)
    transport = TcpTransport(timeout_s=10.0, connections_per_peer=1, stripe_bytes=1 << 62)
    try:
        transport.read_into(holder.server.endpoint, replica.alloc_id, replica.offset, memoryview(out))
    finally:
        transport.close()
    return np.frombuffer(out, dtype=np.uint8)


def test_a_chunk_file_with_no_disk_tier_among_the_peers_is_copied_to_a_host_tier(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, tmp_path: Path
) -> None:
    source = direct_agent(namespace, host_bytes=16 * MiB, disk_path=str(tmp_path), disk_bytes=64 * MiB)
    dying = direct_agent(namespace, host_bytes=16 * MiB)
    client = client_of(namespace)
    values = {f"cf/{i}": np.random.default_rng(i).integers(0, 255, 256 << 10, dtype=np.uint8) for i in range(6)}
    client.put_many(values, replicas=2, preferred_node=source.node_id)
    demote_all(source, list(values))
    assert all(
        {(r.node_id, r.tier) for r in replicas(source, k)}
        == {
            (source.node_id, TierKind.DISK),
            (dying.node_id, TierKind.HOST),
        }
        for k in values
    )
    target = direct_agent(namespace, host_bytes=16 * MiB)  # a host tier only, like every peer
    reap(source, dying)

    assert source.pressure.repairs.run_once(set()) == len(values)
    assert counter(source, TierKind.DISK, "copies_out") == len(values)
    for key, value in values.items():
        placed = {(r.node_id, r.tier): r for r in replicas(source, key)}
        assert set(placed) == {(source.node_id, TierKind.DISK), (target.node_id, TierKind.HOST)}, key
        assert np.array_equal(read_back(target, placed[target.node_id, TierKind.HOST]), value), key
    assert source.index.repair_candidates(source.node_id) == []
    assert client.stat().short == 0


def test_a_host_object_with_no_host_room_among_the_peers_is_copied_to_a_disk_tier(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, tmp_path: Path
) -> None:
    source = direct_agent(namespace, host_bytes=16 * MiB)  # no disk tier of its own
    dying = direct_agent(namespace, host_bytes=16 * MiB)
    client = client_of(namespace)
    # float16, as KV caches are: the chunk files made for the copies shuffle their byte planes.
    values = {f"hd/{i}": np.linspace(0, i + 1, MiB // 2, dtype=np.float16) for i in range(4)}
    client.put_many(values, replicas=2, preferred_node=source.node_id)
    # Its host tier takes no 1 MiB object under its high watermark: the copies go to its disk.
    target = direct_agent(namespace, host_bytes=MiB, disk_path=str(tmp_path), disk_bytes=64 * MiB)
    reap(source, dying)

    assert source.pressure.repairs.run_once(set()) == len(values)
    assert counter(source, TierKind.HOST, "copies_out") == len(values)
    target.sync_once()  # the copies' acks: the files are its own now
    assert target.disk is not None and target.disk.objects == len(values)
    assert target.disk.stored_bytes < len(values) * MiB  # chunk files, compressed here
    for key, value in values.items():
        placed = {(r.node_id, r.tier): r for r in replicas(source, key)}
        assert set(placed) == {(source.node_id, TierKind.HOST), (target.node_id, TierKind.DISK)}, key
        copy = placed[target.node_id, TierKind.DISK]
        assert np.array_equal(read_back(target, copy), value.view(np.uint8)), key
        flags, itemsize, _, _ = DiskTier.parse_header(target.disk.path_of(copy.alloc_id).read_bytes(), where=key)
        assert flags & FLAG_SHUFFLED and itemsize == 2, (key, flags, itemsize)
    assert client.stat().short == 0


def test_a_chunk_file_goes_to_a_peer_whose_memory_tiers_could_hold_it(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str, tmp_path: Path
) -> None:
    """A peer's disk tier takes no chunk file of more plain bytes than its largest memory tier: the
    roomiest disk, on a node whose host tier is smaller than the object, refused the WRITE and was
    chosen again at every call; the object stayed short while another node could take it."""
    source = direct_agent(namespace, host_bytes=16 * MiB)
    dying = direct_agent(namespace, host_bytes=16 * MiB)
    client = client_of(namespace)
    value = np.arange(3 * MiB, dtype=np.uint8)
    client.put("big", value, replicas=2, preferred_node=source.node_id)
    direct_agent(namespace, host_bytes=2 * MiB, disk_path=str(tmp_path / "small"), disk_bytes=64 * MiB)
    # 3 MiB is past this one's host high watermark (90 % of 3.25 MiB), but its memory could hold it.
    fits = direct_agent(namespace, host_bytes=13 * MiB // 4, disk_path=str(tmp_path / "fits"), disk_bytes=32 * MiB)
    reap(source, dying)

    assert source.pressure.repairs.run_once(set()) == 1
    placed = {(r.node_id, r.tier): r for r in replicas(source, "big")}
    assert set(placed) == {(source.node_id, TierKind.HOST), (fits.node_id, TierKind.DISK)}
    assert np.array_equal(read_back(fits, placed[fits.node_id, TierKind.DISK]), value)
