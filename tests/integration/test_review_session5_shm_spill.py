"""Review of the same-host spill path (commit 47ce4ef: agent/spill.py Spiller._copy_all, now
agent/spill_shm.py ArenaCopies.copy_all; the mapping of peers' arenas, now agent/peer_arenas.py
retain, segment; transport/shm.py retain).
Each test names the bug it proves and fails on that code.

Real Agent objects in this process (real servers, arenas in /dev/shm, index scripts against the
session's real Valkey), one namespace so that they see one another; their pressure loop is stubbed
out unless a test needs it, and each test places its interleaving by calling the Spiller's steps
(reserve, copy, swap) and the peer's sync / heartbeat steps itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from helpers import put_on, replicas_of, wait_until

from mooncake_store.agent import pressure as pressure_module
from mooncake_store.agent.node import Agent
from mooncake_store.agent.spill import Spiller, SpillJob
from mooncake_store.types import NodeInfo, TierKind

KiB = 1 << 10
MiB = 1 << 20
SIZE = 256 * KiB


def one_job(agent: Agent, key: str, seed: int) -> tuple[SpillJob, np.ndarray]:
    value = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    put_on(agent, key, value, tier=TierKind.HOST)
    (victim,) = [v for v in agent.index.victim_candidates(agent.node_id, "host") if v.key == key]
    location = agent.table.offset_of(victim.alloc_id)
    assert location is not None
    return SpillJob(victim=victim, offset=location[0]), value


def read_back(agent: Agent, key: str) -> bytes:
    (replica,) = replicas_of(agent, key)
    assert replica.node_id == agent.node_id
    return bytes(agent.arena.view(replica.offset, replica.size_bytes))


def regrant_then_spill(
    spiller: Spiller, row: NodeInfo, b: Agent, reserved: Any, granted_at: int, *, seed: int
) -> tuple[np.ndarray, list[bool]]:
    """Another put on the peer gets the block the spill had reserved (the peer freed it), then the
    sender copies and swaps as a spill does. Returns the other object's bytes and written per job."""
    other = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    put_on(b, "other", other, tier=TierKind.HOST)
    (replica,) = replicas_of(b, "other")
    assert replica.offset == granted_at, "the allocator did not hand the same block out again"
    segment = spiller.arenas.segment(row, TierKind.HOST)
    assert segment is not None
    written = spiller.shm.copy_all(segment, row, reserved)
    spiller._swap(row, reserved.batch, reserved.reservations, written, TierKind.HOST, False, TierKind.HOST)
    return other, written


def test_bug1_a_peer_with_a_shorter_reserve_timeout_has_a_regranted_block_overwritten(
    make_peer_agent: Callable[..., Agent],
) -> None:
    """The copy was guarded by the *sender's* reserve_timeout_s / 2, while the peer reclaims after
    *its own* timeout. A peer with a shorter one (0.3 s here, 30 s on the sender) freed the
    reservation and handed the block to another put while the sender still thought it young: the
    memcpy landed on the peer's committed object. Now the peer's fence decides: a freed
    reservation is not fenced, and nothing is copied into it."""
    a = make_peer_agent(host_bytes=4 * MiB, reserve_timeout_s=30.0)
    b = make_peer_agent(host_bytes=4 * MiB, reserve_timeout_s=0.3)
    job, _ = one_job(a, "victim", 1)
    peer = a.index.nodes()[b.node_id]
    spiller = Spiller(a, streams=1)
    try:
        reserved = spiller._reserve(peer, [job], TierKind.HOST, TierKind.HOST)
        assert reserved is not None
        granted_at = reserved.reservations[0].offset
        time.sleep(0.5)  # past the peer's timeout, far inside the sender's 15 s window
        b.sync_once()  # the peer reclaims the reservation (and deletes the guard): the block is free
        assert len(b.table) == 0
        other, written = regrant_then_spill(spiller, peer, b, reserved, granted_at, seed=99)
    finally:
        spiller.close()
    assert read_back(b, "other") == other.tobytes(), (
        f"the spill copied into a block the peer had freed and re-granted (written={written}): "
        "a committed object on the peer now holds another object's bytes"
    )


def test_bug2_a_reaped_peer_has_a_regranted_block_overwritten(make_peer_agent: Callable[..., Agent]) -> None:
    """Equal timeouts, but the peer frees reservations early: reaped while stalled, its heartbeat
    step (node.py _heartbeat_loop) drops everything (reservations expire now), registers again under
    the same incarnation (same arena, same alloc tag: the sender's row is still right), and its next
    sync frees the block, which the next put gets. The sender's old age check (half of 30 s) passed
    and the memcpy overwrote that put's committed bytes; the peer's FENCE now refuses the block."""
    a = make_peer_agent(host_bytes=4 * MiB)
    b = make_peer_agent(host_bytes=4 * MiB)
    job, _ = one_job(a, "victim", 2)
    peer = a.index.nodes()[b.node_id]
    spiller = Spiller(a, streams=1)
    try:
        reserved = spiller._reserve(peer, [job], TierKind.HOST, TierKind.HOST)
        assert reserved is not None
        granted_at = reserved.reservations[0].offset
        # The peer stalls past its heartbeat deadline and a reaper purges its record.
        b.index.redis.zadd(b.index.prefix + "hb", {b.node_id: 1})
        assert b.node_id in a.index.reap_dead_nodes(grace_ms=0)
        # b's heartbeat step, as its loop runs it: record gone -> drop everything, register again.
        b.heartbeat_once()
        b.sync_once()  # frees the expired reservation
        assert len(b.table) == 0
        row = a.index.nodes()[b.node_id]  # a fresh row: same arena, same tag
        assert row.shm_name == peer.shm_name and row.alloc_tag == peer.alloc_tag
        other, written = regrant_then_spill(spiller, row, b, reserved, granted_at, seed=77)
    finally:
        spiller.close()
    assert read_back(b, "other") == other.tobytes(), (
        f"the spill copied into a reservation the reaped peer had freed and re-granted (written={written})"
    )


def _mapped_paths() -> str:
    return Path("/proc/self/maps").read_text()


def test_bug3_a_departed_peers_arena_stays_mapped_while_there_is_no_pressure(
    make_peer_agent: Callable[..., Agent],
) -> None:
    """retain() ran only inside a pressure pass (_walk), and a pass only runs while a tier is past
    its watermark. A peer that left while this agent was not under pressure stayed mapped (its whole
    arena kept allocated after its file is unlinked) until the next pressure episode, if any. Now
    the pressure loop reads the node table every RETAIN_EVERY_S while any peer arena is mapped."""
    a = make_peer_agent(host_bytes=4 * MiB, real_pressure=True, pressure_interval_s=0.02)
    b = make_peer_agent(host_bytes=4 * MiB)
    spiller = a.pressure._spiller
    assert spiller.arenas.segment(a.index.nodes()[b.node_id], TierKind.HOST) is not None  # a spill mapped it
    name = b.arena.name
    b.stop()  # leaves the node table, unlinks its segment
    assert b.node_id not in a.index.nodes()
    gone = wait_until(lambda: name not in spiller.arenas.shm._segments, 3 * pressure_module.RETAIN_EVERY_S)
    still = [line for line in _mapped_paths().splitlines() if name in line]
    assert gone and not still, f"the arena of a peer that left is still mapped: {still[:1]}"


def test_bug4_mapping_a_no_prefault_peer_allocates_its_whole_arena(make_peer_agent: Callable[..., Agent]) -> None:
    """SharedSegment.attach used MAP_POPULATE for every peer: on tmpfs, populating a shared mapping
    allocates every page of the file, so a peer started with --no-prefault (sparse arena) had its
    whole arena made resident by a neighbour. A peer's row now says whether it prefaulted, and its
    arena is mapped populated only then (and only when something is spilled to it)."""
    a = make_peer_agent(host_bytes=4 * MiB)
    b = make_peer_agent(host_bytes=64 * MiB, prefault=False)
    path = Path("/dev/shm") / b.arena.name
    before = os.stat(path).st_blocks * 512
    assert before < 8 * MiB
    spiller = Spiller(a, streams=1)
    try:
        assert spiller.arenas.segment(a.index.nodes()[b.node_id], TierKind.HOST) is not None
        after = os.stat(path).st_blocks * 512
    finally:
        spiller.close()
    assert after < 8 * MiB, (
        f"mapping the --no-prefault peer's arena allocated {after >> 20} MiB of /dev/shm (was {before >> 20} MiB)"
    )
