"""Room on the disk tier as a pressure pass plans it and a demotion takes it: the room promised to a
peer's chunk file on the wire is no demotion's, a demotion is planned by the file it can make (not
the object's plain size), and one that does not fit leaves the rest of the pass demoting.

Real in-process agents with disk tiers in temporary directories, the session's real Redis, a peer's
RESERVE and WRITE over real TCP; the pressure loop is idle and the test runs its passes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import counter

from mooncake_store import connect
from mooncake_store.agent.node import Agent
from mooncake_store.agent.placing import PassState
from mooncake_store.errors import KeyNotFound, MooncakeError, NoCapacity
from mooncake_store.policy.eviction import MoveKind
from mooncake_store.tiers.chunk_format import HEADER
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.transport.tcp import PeerConnections
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20


def idle(agent: Agent) -> None:
    """No pressure pass of its own: the test runs them."""
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


def disk_agent(
    make_inproc_agent: Callable[..., Agent],
    tmp_path: Path,
    disk_bytes: int,
    *,
    host_bytes: int = 4 * MiB,
    high: float = 0.2,
) -> Agent:
    """An agent whose tiers are under pressure past ``high`` and drain to 1%."""
    return make_inproc_agent(
        host_bytes=host_bytes,
        disk_path=str(tmp_path / "disks"),
        disk_bytes=disk_bytes,
        high_watermark=high,
        low_watermark=0.01,
        promote_on_read=False,
        prepare=idle,
    )


def put_all(agent: Agent, values: dict[str, np.ndarray]) -> None:
    client = connect(agent.index.url, namespace=agent.namespace)
    try:
        for key, value in values.items():  # in this order: the first is the coldest
            client.put(key, value, preferred_node=agent.node_id)
    finally:
        client.close()
    agent.sync_once()


def tiers_of(agent: Agent, keys: list[str]) -> dict[str, str | None]:
    """Each key's tier on ``agent``, None when it is gone."""
    found = agent.index.lookup(keys, lease_ms=0).objects
    return {key: None if meta is None else str(meta.replicas[0].tier) for key, meta in zip(keys, found, strict=True)}


def incompressible(size: int) -> np.ndarray:
    return np.frombuffer(os.urandom(size), dtype=np.uint8)


def test_a_demotion_never_takes_the_room_promised_to_a_peers_file(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A demotion planned against the room a peer's spill left, but written against the disk's
    free room alone, took the promised room: the peer's WRITE was refused, and the next RESERVE's
    refusal carried a negative free size that could not be packed, so the agent closed the
    connection and the peer left it out of its spills for a heartbeat TTL."""
    source = DiskTier(tmp_path / "peer", 64 * MiB)
    source.write(1, memoryview(incompressible(MiB - 8 * KiB)))
    blob = source.read_blob(1)  # a peer's chunk file: it takes 1 MiB of blocks
    source.close()
    footprint = -(-len(blob) // (4 * KiB)) * 4 * KiB
    # Its host tier is past 60% with the victim; its disk takes a peer's file up to 60% of ~2 MiB.
    agent = disk_agent(make_inproc_agent, tmp_path, MiB + footprint, host_bytes=MiB + MiB // 4, high=0.6)
    assert agent.disk is not None and agent.disk.block_bytes == 4 * KiB
    put_all(agent, {"victim": incompressible(MiB)})
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    try:
        (reservation,) = peer.reserve([(len(blob), b"p" * 16)], node_id=agent.node_id, tier=2, flags=1)
        agent.pressure.relieve_host()  # its file (1 MiB and a header) does not fit beside the promise
        assert agent.disk.free_bytes >= 0
        peer.write(reservation.alloc_id, reservation.offset, memoryview(blob))  # lands in its room
        with pytest.raises(NoCapacity):  # a refusal, and the connection still serves
            peer.reserve([(len(blob), b"q" * 16)], node_id=agent.node_id, tier=2, flags=1)
        peer.free([reservation.alloc_id])
    finally:
        peer.close()
    assert agent.disk.used_bytes <= agent.disk.capacity_bytes
    assert tiers_of(agent, ["victim"]) == {"victim": None}  # no peer, no room: evicted, as a cache does
    assert counter(agent, TierKind.HOST, "evictions") == 1


def test_a_file_that_does_not_fit_leaves_the_rest_of_the_pass_demoting(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A victim of exactly the disk's free room was planned at its plain size; its file (a header
    more, in whole blocks) did not fit, and the pass then took the disk for full: every later
    victim was evicted, though each would have taken one block of the empty disk."""
    agent = disk_agent(make_inproc_agent, tmp_path, MiB)
    smalls = {f"small{i}": np.zeros(64 * KiB, np.uint8) for i in range(3)}
    put_all(agent, {"big": incompressible(MiB), **smalls})
    agent.pressure.relieve_host()
    assert tiers_of(agent, ["big", *smalls]) == {"big": None, **{key: "disk" for key in smalls}}
    assert counter(agent, TierKind.HOST, "demotions") == 3
    assert counter(agent, TierKind.HOST, "evictions") == 1


def test_an_object_larger_than_the_disks_room_is_demoted_when_its_file_fits(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A KV cache of 1 MiB whose file takes one block was evicted from an empty disk of 512 KiB:
    planned at its plain size, it never fitted."""
    agent = disk_agent(make_inproc_agent, tmp_path, 512 * KiB)
    value = np.zeros(MiB // 2, np.float16)
    put_all(agent, {"kv": value})
    agent.pressure.relieve_host()
    assert tiers_of(agent, ["kv"]) == {"kv": "disk"}
    client = connect(agent.index.url, namespace=agent.namespace)
    try:
        assert np.array_equal(client.get("kv").view(np.float16), value)
    finally:
        client.close()


def test_a_damaged_size_in_a_files_header_drops_its_replica(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A header whose raw size was damaged upward was taken for a destination too small ("freed
    meanwhile"): the replica stayed in the index, every read answered STALE, and nothing counted
    the damage. It is corruption: the replica is dropped, as for a damaged body."""
    agent = disk_agent(make_inproc_agent, tmp_path, 8 * MiB)
    put_all(agent, {"hdr": incompressible(MiB)})
    agent.pressure.relieve_host()
    meta = agent.index.lookup(["hdr"], lease_ms=0).objects[0]
    assert meta is not None and meta.replicas[0].tier == TierKind.DISK
    assert agent.disk is not None
    path = agent.disk.path_of(meta.replicas[0].alloc_id)
    damaged = bytearray(path.read_bytes())
    magic, flags, itemsize, reserved, raw, checksum, clen = HEADER.unpack_from(damaged)
    HEADER.pack_into(damaged, 0, magic, flags, itemsize, reserved, raw + 1, checksum, clen)
    path.write_bytes(damaged)
    client = connect(agent.index.url, namespace=agent.namespace, timeout_s=5)
    try:
        with pytest.raises(KeyNotFound):
            client.get("hdr")
    finally:
        client.close()
    assert counter(agent, TierKind.DISK, "corrupt") == 1
    assert tiers_of(agent, ["hdr"]) == {"hdr": None}


def test_a_disk_smaller_than_one_block_is_refused(make_inproc_agent: Callable[..., Agent], tmp_path: Path) -> None:
    """No file fits in it: the agent started with a disk tier that only ever evicted."""
    where = tmp_path / uuid.uuid4().hex
    with pytest.raises(MooncakeError, match=r"disk tier capacity 1000 B is less than one \d+ B block"):
        disk_agent(make_inproc_agent, where, 1000)
    assert not (where / "disks").exists()  # nothing made is left behind


def test_a_demotion_whose_object_changed_is_not_counted_as_done(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A demotion that lost its swap (the object was replaced while its file was written) placed
    the victim again with the tier below allowed, was told "demote" once more, and returned that:
    the pass counted bytes that never moved, and could end before making its room."""
    agent = disk_agent(make_inproc_agent, tmp_path, 8 * MiB)
    put_all(agent, {"changing": incompressible(MiB)})
    (victim,) = [c for c in agent.index.victim_candidates(agent.node_id, "host") if c.key == "changing"]
    job = agent.pressure._host_job(victim)
    assert job is not None
    real_demote = agent.pressure.moves.demote_to_disk

    def replaced_meanwhile(*args: object) -> object:
        put_all(agent, {"changing": incompressible(MiB)})  # a writer replaces it as the file is written
        return real_demote(*args)  # type: ignore[arg-type]

    agent.pressure.moves.demote_to_disk = replaced_meanwhile  # type: ignore[method-assign]
    state = PassState(peers=[])
    now_ms = agent.index.server_time_ms()
    move = agent.pressure.placer.place_demoting(job, now_ms, state, TierKind.HOST)
    assert move.kind != MoveKind.DEMOTE
    assert not state.demote_failed  # the disk is fine: later victims still demote
    assert counter(agent, TierKind.HOST, "demotions") == 0
    assert tiers_of(agent, ["changing"]) == {"changing": "host"}  # the new value, where it was put
