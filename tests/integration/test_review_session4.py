"""Review of the commits after 7637d63: LocalMoves.settle() and the move targets it frees.

A local move (demotion to disk) whose compare-and-swap answer is lost, and the lookup after it too,
keeps its chunk file and remembers it; settle() asks the index again later and frees the file if
the index does not name it. These tests showed settle() freeing a file that the index still names,
or that a reader's live lease still protects (DESIGN.md §3.3, §3.4); fixed since: settle() reads
the record itself, asks before it reads the graveyard, and asks the graveyard about exactly its
targets. Real agents, real disk tiers, the session's real Redis/Valkey; the index's failures are
injected on the agent's index client (as tests/integration/test_moves_cut_short.py does), and the
pressure loop is stubbed so that the test alone calls settle() (as the pressure loop would, before
a pass).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
from helpers import wait_until

from mooncake_store import connect
from mooncake_store.agent.node import Agent
from mooncake_store.errors import ConnectError
from mooncake_store.types import TierKind

MiB = 1 << 20


def unreachable(*_args: object, **_kwargs: object) -> None:
    raise ConnectError("index unreachable (injected)")


class DownRedis:
    """The agent's redis-py client while the index is unreachable: every command fails."""

    def __getattr__(self, name: str) -> Callable[..., object]:
        def fail(*_args: object, **_kwargs: object) -> object:
            raise redis.ConnectionError("index unreachable (injected)")

        return fail


class Hooked:
    """The agent's redis-py client, calling ``after`` once a graveyard read (of any form) returns."""

    def __init__(self, real: object, after: Callable[[], None]) -> None:
        self._real, self._after = real, after

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._real, name)
        if name not in ("zrange", "zscore", "zmscore", "zrangebyscore"):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            out = attr(*args, **kwargs)
            self._after()
            return out

        return call


@pytest.fixture
def make_disk_agent(make_inproc_agent: Callable[..., Agent], tmp_path: Path) -> Callable[..., Agent]:
    def make(**overrides: object) -> Agent:
        def prepare(agent: Agent) -> None:
            agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]

        settings: dict[str, object] = {"host_bytes": 8 * MiB, "disk_path": str(tmp_path), "disk_bytes": 16 * MiB}
        settings.update(overrides)
        return make_inproc_agent(prepare=prepare, **settings)

    return make


def demote_unsure(agent: Agent, key: str) -> int:
    """Demote ``key`` to disk; the swap lands but its answer is lost, and the index stays
    unreachable for whatever the agent asks next: the chunk file is kept and remembered for
    settle(). Returns its alloc id."""
    (victim,) = [c for c in agent.index.victim_candidates(agent.node_id, "host") if c.key == key]
    location = agent.table.offset_of(victim.alloc_id)
    assert location is not None
    index = agent.index
    real_run, real_redis = index._run, index.redis

    def down(name: str, *args: object, **kwargs: object) -> object:
        if name == "move_replica":
            real_run(name, *args, **kwargs)  # type: ignore[arg-type]
            raise ConnectError("connection lost before the answer (injected)")
        raise ConnectError("index unreachable (injected)")

    index._run = down  # type: ignore[method-assign]
    index.redis = DownRedis()  # type: ignore[assignment]
    try:
        assert agent.pressure.moves.demote_to_disk(victim, location[0]), "kept while the index cannot say"
        assert agent.pressure.moves.settle() == 0  # still unreachable: kept for later
    finally:
        index._run, index.redis = real_run, real_redis  # type: ignore[method-assign]
    files = [a for a in agent.disk_keys if agent.disk_keys[a] == key]
    assert len(files) == 1
    disk_id = files[0]
    assert agent.disk is not None and agent.disk.entry(disk_id) is not None
    return disk_id


def names(agent: Agent, key: str, disk_id: int) -> bool:
    meta = agent.index.lookup([key], lease_ms=0).objects[0]
    return meta is not None and any(r.alloc_id == disk_id and r.tier == TierKind.DISK for r in meta.replicas)


def test_settle_after_an_outage_keeps_a_file_the_index_names_while_heartbeats_lag(
    make_disk_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outage that made the move unsure also stopped this agent's heartbeats: its deadline
    passes (it is not reaped yet). When the index answers again, settle() may run before the next
    heartbeat; lookup() leaves out replicas on nodes past their deadline, so settle() reads "not
    named" and deletes the chunk file that the index still names as the object's only replica."""
    agent = make_disk_agent(heartbeat_interval_s=0.1, heartbeat_ttl_s=0.5)
    key = f"hb-{uuid.uuid4().hex[:6]}"
    value = np.arange(MiB // 2, dtype=np.float16)
    with connect(agent.index.url, namespace=agent.namespace) as client:
        client.put(key, value, preferred_node=agent.node_id)
        disk_id = demote_unsure(agent, key)
        disk = agent.disk
        assert disk is not None
        # The index was down for longer than the heartbeat TTL: no heartbeat got through.
        monkeypatch.setattr(agent.index, "heartbeat", unreachable)
        assert wait_until(lambda: agent.index.lookup([key], lease_ms=0).objects[0] is None, 5.0)
        # The index is back; the pressure loop's settle() comes before the heartbeat thread's turn.
        agent.pressure.moves.settle()
        monkeypatch.undo()
        assert wait_until(lambda: names(agent, key, disk_id), 5.0), "the swap landed: the index names the file"
        assert disk.entry(disk_id) is not None and disk_id in agent.disk_keys, (
            "settle() deleted the chunk file that the index names as the object's only replica"
        )
        np.testing.assert_array_equal(client.get(key), value)


def test_settle_keeps_a_buried_file_past_the_first_4096_graves(make_disk_agent: Callable[..., Agent]) -> None:
    """settle() takes the graveyard from pending_graves(), which returns at most 4096 graves (the
    earliest due). A target whose swap landed and whose object was then removed under a reader's
    lease is a grave due later than those: settle() does not see it, reads "not named" and deletes
    the file while the reader's lease is live (DESIGN.md §3.3)."""
    agent = make_disk_agent(host_bytes=16 * MiB)
    key = f"buried-{uuid.uuid4().hex[:6]}"
    value = np.arange(MiB // 2, dtype=np.float16)
    with connect(agent.index.url, namespace=agent.namespace) as client:
        client.put(key, value, preferred_node=agent.node_id)
        disk_id = demote_unsure(agent, key)
        disk = agent.disk
        assert disk is not None
        # A busy node: 4096 removed objects whose readers' leases end within the minute.
        fillers = [f"f-{i}" for i in range(4096)]
        client.put_many(
            {f: np.full(16, i % 251, np.uint8) for i, f in enumerate(fillers)}, preferred_node=agent.node_id
        )
        agent.index.lookup(fillers, lease_ms=60_000)
        assert all(client.remove_many(fillers))
        # A reader looks the object up (its only replica is the chunk file), then it is removed.
        got = agent.index.lookup([key], lease_ms=120_000).objects[0]
        assert got is not None and [r.alloc_id for r in got.replicas] == [disk_id]
        assert client.remove(key)
        graveyard = agent.index.redis.zrange(agent.index.prefix + "gc:" + agent.node_id, 0, -1)
        assert len(graveyard) > 4096 and disk_id in {int(g) for g in graveyard}
        agent.pressure.moves.settle()
        assert disk.entry(disk_id) is not None, "settle() freed a grave whose read lease is live"


def test_settle_keeps_a_file_buried_between_its_graveyard_read_and_its_question(
    make_disk_agent: Callable[..., Agent],
) -> None:
    """settle() reads the graveyard first and asks about each target after. A client's remove
    (under a reader's lease) landing in between buries the target: settle() sees "not named" and
    a stale graveyard without it, and deletes the file while the reader's lease is live."""
    agent = make_disk_agent()
    key = f"race-{uuid.uuid4().hex[:6]}"
    value = np.arange(MiB // 2, dtype=np.float16)
    with connect(agent.index.url, namespace=agent.namespace) as client:
        client.put(key, value, preferred_node=agent.node_id)
        disk_id = demote_unsure(agent, key)
        disk = agent.disk
        assert disk is not None
        got = agent.index.lookup([key], lease_ms=60_000).objects[0]  # a reader's lease
        assert got is not None and [r.alloc_id for r in got.replicas] == [disk_id]
        fired: list[bool] = []

        def remove_lands() -> None:
            # Another process's remove reaches Redis right after settle() reads the graveyard.
            if not fired:
                fired.append(True)
                assert client.remove(key)

        real_redis = agent.index.redis
        agent.index.redis = Hooked(real_redis, remove_lands)  # type: ignore[assignment]
        try:
            agent.pressure.moves.settle()
        finally:
            agent.index.redis = real_redis  # type: ignore[assignment]
        remove_lands()  # a settle() that read no graveyard: the remove comes after it
        assert not client.exists(key)
        assert disk.entry(disk_id) is not None, "settle() freed a grave whose read lease is live"
