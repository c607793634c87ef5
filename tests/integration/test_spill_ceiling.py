"""A peer takes a spill only up to its own high watermark.

The spiller plans by the node table, whose use is a heartbeat old: a peer that had filled since
(its own writers, other agents' spills) was pushed past its high watermark, up to full, and its
pressure pass then spilled the newcomers back, or on, while the writer that started it waited:
spills went back and forth between two agents. The peer now refuses a spill's reservation that
would take the tier past its high watermark (as it would be planned with a fresh table); a put's
reservation still gets the room up to the full capacity.

Real in-process agents in one namespace on the session's real Redis; the pressure loops idle, the
test drives the Spiller; the RESERVE frames go over real TCP."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import put_on, replicas_of

from mooncake_store.agent.node import Agent
from mooncake_store.agent.spill import Spiller, SpillJob
from mooncake_store.errors import NoCapacity
from mooncake_store.transport.frames import SPILL_FLAG, TIER_DISK, TIER_HOST
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20
SIZE = 256 * KiB


def host_jobs(agent: Agent, prefix: str, count: int) -> list[SpillJob]:
    """``count`` objects of SIZE committed on ``agent``'s host tier, as spill jobs."""
    for i in range(count):
        put_on(agent, f"{prefix}{i}", np.full(SIZE, i, np.uint8), tier=TierKind.HOST)
    victims = [c for c in agent.index.victim_candidates(agent.node_id, "host") if c.key.startswith(prefix)]
    return [SpillJob(victim=v, offset=agent.table.offset_of(v.alloc_id)[0]) for v in victims]  # type: ignore[index]


@pytest.mark.parametrize("spill_shm", [True, False], ids=["shm", "tcp"])
def test_a_peer_takes_a_spill_up_to_its_high_watermark_and_the_rest_is_handed_back(
    make_peer_agent: Callable[..., Agent], spill_shm: bool
) -> None:
    a = make_peer_agent(host_bytes=8 * MiB, spill_shm=spill_shm)
    b = make_peer_agent(host_bytes=8 * MiB)  # high watermark 0.9: 7.2 MiB
    row = a.index.nodes()[b.node_id]  # read while b was empty, as a pass's table may be
    host_jobs(b, "own", 24)  # 6 MiB of b's own
    jobs = host_jobs(a, "spill", 8)
    spiller = Spiller(a, streams=2)
    try:
        # 8 x 256 KiB would take b to 8 MiB; 4 take it to 7 MiB, under its mark. Refused whole,
        # the batch was placed again whole (elsewhere, else evicted) though b had room for half.
        first = spiller.spill(row, jobs, tier=TierKind.HOST)
        assert first.refused and [j.victim.key for j in first.moved] == [j.victim.key for j in jobs[:4]]
        assert [j.victim.key for j in first.unsent] == [j.victim.key for j in jobs[4:]]
        assert b.table.usage()[0] == 7 * MiB
        again = spiller.spill(row, first.unsent, tier=TierKind.HOST)  # no room for one more under the mark
    finally:
        spiller.close()
    assert again.refused and again.moved == [] and len(again.unsent) == 4
    assert b.table.usage()[0] == 7 * MiB, "b took a spill past its high watermark"
    # The refused batch's guard record went with the refusal (it stayed for its 300 s TTL), and
    # the one the swap used went with the swap.
    assert [k for k in a.index.redis.scan_iter(match=a.index.prefix + "pend:*")] == []
    assert all(replicas_of(a, j.victim.key)[0].node_id == b.node_id for j in jobs[:4])
    assert all(replicas_of(a, j.victim.key)[0].node_id == a.node_id for j in jobs[4:])
    # A put's reservation still gets the room up to the whole capacity.
    transport = TcpTransport(timeout_s=5.0, connections_per_peer=1, stripe_bytes=1 << 62)
    try:
        peer = transport.peer(b.server.endpoint)
        with pytest.raises(NoCapacity):
            peer.reserve([(SIZE, uuid.uuid4().bytes)], node_id=b.node_id, flags=SPILL_FLAG, tier=TIER_HOST)
        assert len(peer.reserve([(MiB, uuid.uuid4().bytes)], node_id=b.node_id, tier=TIER_HOST)) == 1
    finally:
        transport.close()


def test_odd_sized_objects_are_counted_as_the_arena_takes_them(make_peer_agent: Callable[..., Agent]) -> None:
    """The mark was checked against the objects' own sizes while the arena takes whole 64 B units:
    1842 objects of 4097 B passed (7.55 MB against a 7.55 MB mark) and took 7.66 MB, past it."""
    a = make_peer_agent(host_bytes=16 * MiB)
    b = make_peer_agent(host_bytes=8 * MiB)
    for i in range(1842):
        put_on(a, f"odd{i}", np.full(4097, i % 251, np.uint8), tier=TierKind.HOST)
    victims = [c for c in a.index.victim_candidates(a.node_id, "host", sample=4096) if c.key.startswith("odd")]
    assert len(victims) == 1842
    jobs = [SpillJob(victim=v, offset=a.table.offset_of(v.alloc_id)[0]) for v in victims]  # type: ignore[index]
    spiller = Spiller(a, streams=2)
    try:
        result = spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    mark = int(0.9 * 8 * MiB)
    assert result.refused and 0 < len(result.moved) < len(jobs)
    assert b.table.usage()[0] <= mark < b.table.usage()[0] + 4160, b.table.usage()
    assert len(result.moved) + len(result.unsent) == len(jobs)


def test_a_disk_spill_past_the_peer_s_disk_high_watermark_is_refused(
    make_peer_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    b = make_peer_agent(host_bytes=8 * MiB, disk_path=str(tmp_path), disk_bytes=4 * MiB)
    assert b.disk is not None
    block = b.disk.block_bytes
    transport = TcpTransport(timeout_s=5.0, connections_per_peer=1, stripe_bytes=1 << 62)
    try:
        peer = transport.peer(b.server.endpoint)
        within = int(0.9 * 4 * MiB) // block * block  # files up to the mark are taken
        granted = peer.reserve([(within, uuid.uuid4().bytes)], node_id=b.node_id, flags=SPILL_FLAG, tier=TIER_DISK)
        assert len(granted) == 1
        with pytest.raises(NoCapacity):  # one block more is past it, though the disk has room
            peer.reserve([(block, uuid.uuid4().bytes)], node_id=b.node_id, flags=SPILL_FLAG, tier=TIER_DISK)
    finally:
        transport.close()
