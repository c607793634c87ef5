"""Moves cut short, and what they leave behind.

A local move (demotion to disk) whose compare-and-swap fails with the index unreachable, and the
lookup after it too: whether the swap landed is unknown, so the chunk file is kept (dropping it
under a live replica would lose data). Once the index answers again, the pressure loop's settle()
frees the file if the index does not name it, and keeps it if it does. The index's failures are
injected on the agent's index client; the agent, its disk tier and the Redis server are real.

A spill whose spiller is closed while a batch is on the wire (the agent stopping): the batch's
reservations on the peer are given back at once rather than when they time out there."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mooncake_store import Client, connect
from mooncake_store.agent.node import Agent
from mooncake_store.agent.spill import Spiller, SpillJob
from mooncake_store.errors import ConnectError
from mooncake_store.types import TierKind

MiB = 1 << 20


def unreachable(*_args: object, **_kwargs: object) -> None:
    raise ConnectError("index unreachable (injected)")


@pytest.fixture
def disk_agent(make_inproc_agent: Callable[..., Agent], tmp_path: Path) -> Agent:
    return make_inproc_agent(host_bytes=8 * MiB, disk_path=str(tmp_path), disk_bytes=16 * MiB)


def demote_with_index_down(agent: Agent, key: str, monkeypatch: pytest.MonkeyPatch, *, swap_lands: bool) -> int:
    """Demote ``key`` to disk while the swap's answer is lost (after landing or not) and the lookup
    that would tell fails; returns the chunk file's alloc id."""
    (victim,) = [c for c in agent.index.victim_candidates(agent.node_id, "host") if c.key == key]
    location = agent.table.offset_of(victim.alloc_id)
    assert location is not None
    real_swap = agent.index.move_replica
    written: list[int] = []

    def lost_answer(key: str, **kwargs: object) -> str:
        written.append(kwargs["new"].alloc_id)  # type: ignore[attr-defined]
        if swap_lands:
            real_swap(key, **kwargs)  # type: ignore[arg-type]
        raise ConnectError("connection lost before the answer (injected)")

    monkeypatch.setattr(agent.index, "move_replica", lost_answer)
    monkeypatch.setattr(agent.index, "lookup", unreachable)
    monkeypatch.setattr(agent.index, "replicas_listed", unreachable)
    assert agent.pressure.moves.demote_to_disk(victim, location[0]), "kept while the index cannot say"
    (disk_id,) = written
    assert agent.disk is not None and agent.disk.entry(disk_id) is not None
    # Still unreachable: settle() keeps it for later.
    assert agent.pressure.moves.settle() == 0 and agent.disk.entry(disk_id) is not None
    monkeypatch.undo()
    return disk_id


@pytest.mark.parametrize("swap_lands", [False, True], ids=["swap-lost", "swap-landed"])
def test_a_move_target_the_index_could_not_confirm_is_settled_later(
    disk_agent: Agent, monkeypatch: pytest.MonkeyPatch, swap_lands: bool
) -> None:
    key = f"unsure-{uuid.uuid4().hex[:6]}"
    value = np.arange(MiB // 2, dtype=np.float16)
    with connect(disk_agent.index.url, namespace=disk_agent.namespace) as client:
        client.put(key, value, preferred_node=disk_agent.node_id)
        disk_id = demote_with_index_down(disk_agent, key, monkeypatch, swap_lands=swap_lands)
        disk = disk_agent.disk
        assert disk is not None
        path = disk.path_of(disk_id)
        assert path.exists()
        freed = disk_agent.pressure.moves.settle()
        tiers = [r.tier for r in client.object_meta(key).replicas]  # type: ignore[union-attr]
        if swap_lands:
            assert freed == 0 and path.exists() and disk_id in disk_agent.disk_keys
            assert tiers == [TierKind.DISK]
        else:
            assert freed == 1 and not path.exists() and disk.entry(disk_id) is None
            assert disk_id not in disk_agent.disk_keys
            assert tiers == [TierKind.HOST]
        assert disk_agent.pressure.moves.settle() == 0  # nothing left to ask about
        np.testing.assert_array_equal(client.get(key), value)


def put_and_choose(client: Client, a: Agent, keys: list[str]) -> list[SpillJob]:
    """Put ``keys`` on ``a`` (256 KiB each, key i filled with i + 1) and return them as spill jobs."""
    for i, key in enumerate(keys):
        client.put(key, np.full(256 * 1024, i + 1, np.uint8), preferred_node=a.node_id)
    jobs = []
    for victim in [c for c in a.index.victim_candidates(a.node_id, "host") if c.key in keys]:
        location = a.table.offset_of(victim.alloc_id)
        assert location is not None
        jobs.append(SpillJob(victim=victim, offset=location[0]))
    return jobs


def test_a_spill_cut_short_by_close_gives_the_peers_room_back(make_inproc_agent: Callable[..., Agent]) -> None:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    # A long reservation timeout: anything still reserved on B at the end was not given back.
    a = make_inproc_agent(namespace=namespace, host_bytes=8 * MiB, reserve_timeout_s=600.0, spill_to_peers=True)
    b = make_inproc_agent(namespace=namespace, host_bytes=8 * MiB, reserve_timeout_s=600.0)
    keys = [f"cut-{i}" for i in range(4)]
    with connect(a.index.url, namespace=namespace) as client:
        jobs = put_and_choose(client, a, keys)
        spiller = Spiller(a)
        # What close() does to the swap thread, as if it came while the batch was being written:
        # the bytes reach B, but no swap can be scheduled for them.
        spiller._swapper.shutdown(wait=True)
        try:
            with pytest.raises(RuntimeError, match="shutdown"):
                spiller.spill(a.index.nodes()[b.node_id], jobs)
        finally:
            spiller.close()
        b.sync_once()  # what B's next sync does: free the reservations expired by the FREE frame
        assert len(b.table) == 0 and not b.table.reserved_deadlines(), "the cut batch still holds room on B"
        for i, key in enumerate(keys):  # nothing moved: every object still on A, byte-exact
            assert [r.node_id for r in client.object_meta(key).replicas] == [a.node_id]  # type: ignore[union-attr]
            np.testing.assert_array_equal(client.get(key), np.full(256 * 1024, i + 1, np.uint8))


def test_a_peer_that_hangs_mid_batch_costs_the_spill_one_timeout(
    make_inproc_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """B grants the batch's room and then stops answering (its WRITE handler held, as a peer hung
    mid-transfer). The batch breaks after one timeout; the spill then sent B a FREE for the
    batch's room, which a hung peer answers only after another timeout, the pressure loop waiting
    (and a third for a batch reserved ahead). Now B is sent nothing more: it reclaims the room at
    its own reservation timeout, and every object stays on A, byte-exact."""
    from mooncake_store.agent import spill_jobs
    from mooncake_store.agent.ops import AgentOps
    from mooncake_store.transport.tcp import PeerConnections

    monkeypatch.setattr(spill_jobs, "TIMEOUT_S", 1.0)
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    a = make_inproc_agent(namespace=namespace, host_bytes=8 * MiB, spill_to_peers=True, spill_shm=False)
    b = make_inproc_agent(namespace=namespace, host_bytes=8 * MiB, reserve_timeout_s=2.0)
    hung = threading.Event()
    real_write, real_free = AgentOps._write, PeerConnections.free
    freed_on: list[str] = []

    def write_unless_hung(self: AgentOps, *args: object) -> bool:
        if self._table is b.table:
            hung.wait(30)  # B does not answer until the test ends
        return real_write(self, *args)  # type: ignore[arg-type]

    def recorded_free(self: PeerConnections, alloc_ids: object) -> int:
        freed_on.append(self.endpoint)
        return real_free(self, alloc_ids)  # type: ignore[arg-type]

    monkeypatch.setattr(AgentOps, "_write", write_unless_hung)
    monkeypatch.setattr(PeerConnections, "free", recorded_free)
    keys = [f"hang-{i}" for i in range(4)]
    with connect(a.index.url, namespace=namespace) as client:
        jobs = put_and_choose(client, a, keys)
        b_node = a.index.nodes()[b.node_id]
        spiller = Spiller(a)
        try:
            result = spiller.spill(b_node, jobs)
        finally:
            hung.set()
            spiller.close()
        assert result.refused and not result.moved and len(result.unsent) == len(jobs)
        assert b_node.tcp_endpoint not in freed_on, "a FREE was sent to the peer that hung"
        for i, key in enumerate(keys):
            assert [r.node_id for r in client.object_meta(key).replicas] == [a.node_id]  # type: ignore[union-attr]
            np.testing.assert_array_equal(client.get(key), np.full(256 * 1024, i + 1, np.uint8))
