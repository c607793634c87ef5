"""A spill's WRITEs roll from one batch into the next (agent/spill_writes.py): the streams stay up
for the whole spill, a batch is swapped only once every
piece of it came back, a peer that refuses a batch has the batch after it (already on its way)
called back, and one that dies mid-spill gets nothing swapped that was not settled before it broke.

Real Agent objects in this process (real servers, arenas in /dev/shm, index scripts against the
session's real Valkey), their pressure loops stubbed out: each test drives a Spiller itself."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import host_spill_jobs, replicas_of

from mooncake_store import LocalCluster
from mooncake_store.agent.node import Agent
from mooncake_store.agent.spill import Spiller, SpillJob
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20
SIZE = 256 * KiB


def filled(agent: Agent, count: int) -> tuple[list[SpillJob], dict[str, np.ndarray]]:
    return host_spill_jobs(agent, count, SIZE, prefix="r")


def count_stream_calls(spiller: Spiller, a: Agent, b: Agent) -> list[int]:
    """Count the WRITE streams the spiller opens to ``b`` (one write_pulled call each)."""
    conns = spiller.transport.peer(a.index.nodes()[b.node_id].tcp_endpoint)
    real = conns.write_pulled
    calls: list[int] = []

    def counted(take: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(take, **kwargs)

    conns.write_pulled = counted  # type: ignore[method-assign]
    return calls


def test_the_streams_stay_up_across_the_batches_of_a_spill(make_peer_agent: Callable[..., Agent]) -> None:
    """Five batches of two objects over two streams: each stream is opened once for the whole
    spill (the streams were opened per batch, and stopped at the end of each), every object is
    swapped to the peer and reads back byte-exact there."""
    a = make_peer_agent(host_bytes=8 * MiB, spill_shm=False)
    b = make_peer_agent(host_bytes=8 * MiB)
    jobs, values = filled(a, 10)
    spiller = Spiller(a, streams=2, batch_bytes=2 * SIZE)  # two objects a batch, every batch alike
    calls = count_stream_calls(spiller, a, b)
    try:
        result = spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    assert sorted(j.victim.key for j in result.moved) == sorted(values), result
    assert not result.refused and not result.unsent
    assert len(calls) == 2, f"{len(calls)} streams were opened for one spill of five batches"
    assert b.server.counters["writes"] == 10
    for key, value in values.items():
        (replica,) = replicas_of(a, key)
        assert replica.node_id == b.node_id, key
        assert bytes(b.arena.view(replica.offset, SIZE)) == value.tobytes(), key


def test_a_batch_refused_whole_calls_back_the_batch_behind_it(make_peer_agent: Callable[..., Agent]) -> None:
    """The peer refuses every WRITE of the first batch (its reservations went: timed out there),
    while the second batch's WRITEs are already queued behind it. Nothing more goes to the peer:
    the second batch is called back, its room there given back, and every object stays on its
    node, byte-exact, handed back unsent (the first batch's as refused at its writes)."""
    a = make_peer_agent(host_bytes=8 * MiB, spill_shm=False)
    b = make_peer_agent(host_bytes=8 * MiB)
    jobs, values = filled(a, 6)
    spiller = Spiller(a, streams=2, batch_bytes=2 * SIZE)  # three batches
    real_views = spiller._views
    seen: list[int] = []

    def first_batch_timed_out(*args: Any) -> Any:
        reserved = args[0]
        seen.append(len(reserved.batch))
        if len(seen) == 1:  # the first batch's room goes before its bytes arrive
            assert b.table.expire_now([r.alloc_id for r in reserved.reservations]) == 2
            b.sync_once()
        return real_views(*args)

    spiller._views = first_batch_timed_out  # type: ignore[method-assign]
    try:
        result = spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    assert seen == [2, 2], f"batches queued: {seen} (the second goes out before the first is settled)"
    assert not result.moved and result.refused
    assert sorted(j.victim.key for j in result.unsent) == sorted(values)
    assert result.write_refused == {j.victim.alloc_id for j in jobs[:2]}
    b.sync_once()
    assert not b.table.reserved_deadlines(), "the called-back batch's room stays reserved on the peer"
    for key, value in values.items():
        (replica,) = replicas_of(a, key)
        assert replica.node_id == a.node_id, key
        assert bytes(a.arena.view(replica.offset, SIZE)) == value.tobytes(), key


def test_a_peer_that_dies_mid_spill_gets_nothing_swapped_after_the_break(
    make_cluster: Callable[..., LocalCluster], direct_agent: Callable[..., Agent]
) -> None:
    """A peer process killed (SIGKILL, its pid) once the first batch is wholly acked and before the
    second batch's WRITEs: the first batch may have been swapped to it (settled before the break
    was seen), but nothing of the second or third is, and every object not swapped is still on its
    node, byte-exact."""
    cluster = make_cluster(0, heartbeat_ttl_s=4.0, host_bytes=16 * MiB)
    peer = cluster.add_agent(node_id="rolling-peer")
    a = direct_agent(cluster.namespace, spill_to_peers=True, spill_shm=False, host_bytes=8 * MiB)
    jobs, values = filled(a, 6)
    spiller = Spiller(a, streams=2, batch_bytes=2 * SIZE)  # three batches of two
    conns = spiller.transport.peer(a.index.nodes()[peer.node_id].tcp_endpoint)
    real = conns.write_pulled
    order = threading.Lock()
    killed = threading.Event()

    def one_stream_kills_after_the_first_batch(take: Any, **kwargs: Any) -> Any:
        # One stream only writes (the other sends nothing): it takes the first batch's two pieces,
        # writes them and reads their acks, then kills the peer and goes on to the next batch.
        if not order.acquire(blocking=False):
            return []
        pieces = [take(True), take(True)]
        out = real(lambda _wait: pieces.pop(0) if pieces else None, **kwargs)
        os.kill(peer.process.pid, signal.SIGKILL)
        peer.process.wait(timeout=10)
        killed.set()
        return out + real(take, **kwargs)

    conns.write_pulled = one_stream_kills_after_the_first_batch  # type: ignore[method-assign]
    try:
        result = spiller.spill(a.index.nodes()[peer.node_id], jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    assert killed.is_set()
    moved = {j.victim.key for j in result.moved}
    assert moved <= {j.victim.key for j in jobs[:2]}, f"swapped to the dead peer beyond the acked batch: {moved}"
    assert result.refused
    for key, value in values.items():
        if key in moved:
            continue
        (replica,) = replicas_of(a, key)
        assert replica.node_id == a.node_id, key
        assert bytes(a.arena.view(replica.offset, SIZE)) == value.tobytes(), key


def test_a_spill_cut_short_gives_back_the_room_of_every_batch_under_way(
    make_peer_agent: Callable[..., Agent],
) -> None:
    """The swap thread is gone (as close() leaves it) while three batches go out: the first batch's
    swap cannot be scheduled, the spill raises, and the room of that batch and of the batches
    queued behind it goes back on the peer at once; nothing moved, every object byte-exact."""
    a = make_peer_agent(host_bytes=8 * MiB, spill_shm=False, reserve_timeout_s=600.0)
    b = make_peer_agent(host_bytes=8 * MiB, reserve_timeout_s=600.0)
    jobs, values = filled(a, 6)
    spiller = Spiller(a, streams=2, batch_bytes=2 * SIZE)  # three batches of two
    spiller._swapper.shutdown(wait=True)
    try:
        with pytest.raises(RuntimeError, match="shutdown"):
            spiller.spill(a.index.nodes()[b.node_id], jobs, tier=TierKind.HOST)
    finally:
        spiller.close()
    b.sync_once()  # frees the reservations the FREE frames expired
    assert len(b.table) == 0 and not b.table.reserved_deadlines(), "a batch's room is still held on the peer"
    for key, value in values.items():
        (replica,) = replicas_of(a, key)
        assert replica.node_id == a.node_id, key
        assert bytes(a.arena.view(replica.offset, SIZE)) == value.tobytes(), key
