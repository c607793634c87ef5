"""Review of 9e43523: AllocationTable keeps COMMITTED allocations as a running count (``_committed``)
and RESERVED ones in a dict of their own (``_reserved``) instead of scanning every allocation in
usage() and reserved_deadlines(); plan_sync asks ``holds(alloc_id)`` per id (Agent.holds) instead of
taking a set of every id the agent knows.

Checked here: the two structures never drift from a scan of the table, through every transition
(reserve and its all-or-nothing rollback, commit (twice, of a doomed reservation), free at once or
deferred behind a reader, a TCP write or a fence, end_read / end_write releasing the doomed,
expire_now, drop_after_reap), single-threaded and from many threads at once; the same for a real
in-process agent's host table and disk inbox after real puts, replacements, removes, FREEs, disk
spills in (acked and abandoned) and syncs; an ack whose whole put happened after the sync took its
deadlines is committed; and no RESERVE, sync, heartbeat or usage() call visits every allocation
(counted, not timed)."""

from __future__ import annotations

import contextlib
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from helpers import run_for, wait_until

from mooncake_store import Client
from mooncake_store.agent.allocations import AllocationTable, AllocState
from mooncake_store.agent.node import Agent
from mooncake_store.errors import ReservationExpired
from mooncake_store.index.client import PendingPut
from mooncake_store.policy.reclaim import plan_sync
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.transport.frames import SPILL_FLAG, TIER_DISK
from mooncake_store.transport.tcp import PeerConnections
from mooncake_store.types import Replica, ReplicaState, TierKind

KiB = 1 << 10
MiB = 1 << 20


# ---- a scan of the table, the way usage() and reserved_deadlines() used to answer ---------------
def assert_consistent(table: AllocationTable, where: str = "") -> None:
    """The running count and the reservation dict agree with a scan of every allocation, and the
    allocator holds exactly the live allocations' blocks."""
    with table._lock:
        allocs = dict.copy(table._allocs)  # not through an instrumented subclass's methods
        committed = sum(1 for a in dict.values(allocs) if a.state == AllocState.COMMITTED)
        reserved = {i for i, a in dict.items(allocs) if a.state == AllocState.RESERVED}
        assert table._committed == committed, f"{where}: committed count {table._committed}, scan {committed}"
        assert set(table._reserved) == reserved, (
            f"{where}: _reserved has {sorted(set(table._reserved) - reserved)[:5]} extra, "
            f"lacks {sorted(reserved - set(table._reserved))[:5]}"
        )
        for alloc_id, alloc in table._reserved.items():
            assert dict.get(allocs, alloc_id) is alloc, f"{where}: _reserved[{alloc_id}] is not the live allocation"
        live = {a.offset for a in dict.values(allocs)}
        assert set(table._allocator._live) == live, f"{where}: allocator blocks differ from the live allocations"
        for alloc in dict.values(allocs):
            assert alloc.readers >= 0, f"{where}: allocation {alloc.alloc_id} has {alloc.readers} readers"
    deadlines = table.reserved_deadlines()
    assert set(deadlines) == reserved
    assert table.usage()[3] == committed


# ---- unit level: every transition, one thread ---------------------------------------------------
def test_counts_follow_fences_writes_doomed_commits_and_rollbacks() -> None:
    """A random walk that, unlike tests/unit/test_allocation_table.py, also holds TCP writes and
    fences (begin_write / end_write), commits doomed reservations, commits while a fence is held,
    and checks _reserved (not only the count) and the allocator after every step."""
    rng = random.Random(20261129)
    table = AllocationTable(256 * KiB, reserve_timeout_s=60.0, alignment=64)
    readers: list[int] = []
    writers: list[int] = []
    for step in range(6000):
        ids = sorted(table.known_ids())
        op = rng.random()
        if op < 0.25 or not ids:
            sizes = [rng.randrange(0, 8 * KiB) for _ in range(rng.randrange(1, 6))]
            if rng.random() < 0.1:
                sizes.append(1 << 30)  # never fits: the whole batch is rolled back
            table.reserve([(s, uuid.uuid4().bytes) for s in sizes])
        elif op < 0.40:
            picked = rng.sample(ids, min(len(ids), rng.randrange(1, 5)))
            table.commit(picked + picked[:1] + [10**15])  # twice, and an id nobody holds
        elif op < 0.52:
            table.free(rng.sample(ids, min(len(ids), rng.randrange(1, 5))))
        elif op < 0.62:
            alloc_id = rng.choice(ids)
            loc = table.offset_of(alloc_id)
            if loc is not None and table.begin_read(alloc_id, *loc):
                readers.append(alloc_id)
        elif op < 0.72:
            alloc_id = rng.choice(ids)
            loc = table.offset_of(alloc_id)
            if loc is not None and table.begin_write(alloc_id, *loc):  # a TCP write, or a FENCE
                writers.append(alloc_id)
        elif op < 0.80 and readers:
            table.end_read(readers.pop(rng.randrange(len(readers))))
        elif op < 0.88 and writers:
            table.end_write(writers.pop(rng.randrange(len(writers))))
        elif op < 0.95:
            table.expire_now(rng.sample(ids, min(len(ids), 3)))
        elif op < 0.97:
            table.drop_after_reap()
            table.hold_reaped({})  # registered again, no read lease running on any of them
        assert_consistent(table, f"step {step}")
    for alloc_id in readers:
        table.end_read(alloc_id)
    for alloc_id in writers:
        table.end_write(alloc_id)
    table.free(sorted(table.known_ids()))
    assert_consistent(table, "end")
    assert len(table) == 0 and table.usage()[:2] == (0, 256 * KiB)


def test_a_doomed_reservation_committed_then_released_by_its_writer() -> None:
    """The sync frees a reservation a TCP write is still filling (doomed), then a late ack commits
    it: the count rises and falls again when the writer's end_write releases it."""
    table = AllocationTable(64 * KiB, reserve_timeout_s=60.0)
    (alloc,) = table.reserve([(4 * KiB, b"p" * 16)]) or []
    assert table.begin_write(alloc.alloc_id, alloc.offset, alloc.length)
    assert table.free([alloc.alloc_id]) == 1  # doomed, kept for the writer
    assert_consistent(table, "doomed")
    assert table.reserved_deadlines().keys() == {alloc.alloc_id}  # still a reservation the sync asks about
    table.commit([alloc.alloc_id])
    assert_consistent(table, "doomed and committed")
    assert table.usage()[3] == 1
    assert table.end_write(alloc.alloc_id) is False  # the write is void, the block released
    assert_consistent(table, "released")
    assert len(table) == 0 and table.usage()[3] == 0


def test_drop_after_reap_keeps_reservations_and_dooms_read_objects() -> None:
    table = AllocationTable(64 * KiB, reserve_timeout_s=60.0)
    a, b, c = table.reserve([(KiB, b"a" * 16), (KiB, b"b" * 16), (KiB, b"c" * 16)]) or []
    table.commit([a.alloc_id, b.alloc_id])
    assert table.begin_read(b.alloc_id, b.offset, b.length)
    table.drop_after_reap()
    table.hold_reaped({})  # registered again, no read lease running on any of them
    assert_consistent(table, "after the reap")
    assert table.usage()[3] == 1  # b, doomed behind its reader; a released
    assert set(table.reserved_deadlines()) == {c.alloc_id}
    table.end_read(b.alloc_id)
    assert_consistent(table, "reader done")
    assert table.usage()[3] == 0 and table.known_ids() == {c.alloc_id}


# ---- unit level: many threads at once -------------------------------------------------------------
def test_counts_survive_every_transition_from_many_threads() -> None:
    """Server threads (reserve, read, write/fence, FREE), the sync (commit, free) and the pressure
    thread (reserve + commit of a move target, free of a failed one) all at once on one table."""
    table = AllocationTable(1 * MiB, reserve_timeout_s=0.001, alignment=64)
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            while not stop.is_set():
                op = rng.random()
                if op < 0.3:
                    got = table.reserve([(rng.randrange(1, 4 * KiB), b"x" * 16) for _ in range(rng.randrange(1, 4))])
                    if got:
                        mine.extend(a.alloc_id for a in got)
                        if rng.random() < 0.3:  # a move target: committed at once
                            table.commit([got[0].alloc_id])
                elif op < 0.45 and mine:
                    table.commit(rng.sample(mine, min(3, len(mine))))
                elif op < 0.6 and mine:
                    alloc_id = rng.choice(mine)
                    loc = table.offset_of(alloc_id)
                    if loc is not None:
                        if rng.random() < 0.5:
                            if table.begin_read(alloc_id, *loc):
                                table.end_read(alloc_id)
                        elif table.begin_write(alloc_id, *loc):
                            if rng.random() < 0.5:
                                table.free([alloc_id])  # freed under the writer: doomed
                            table.end_write(alloc_id)
                elif op < 0.75 and mine:
                    table.expire_now(rng.sample(mine, min(2, len(mine))))
                elif op < 0.9 and mine:
                    victims = rng.sample(mine, min(3, len(mine)))
                    table.free(victims)
                    mine = [a for a in mine if a not in victims]
                else:  # what the sync does with expired reservations
                    deadlines = table.reserved_deadlines()
                    table.free([a for a in deadlines if rng.random() < 0.5])
                    table.usage()
        except BaseException as exc:
            errors.append(exc)

    run_for(2.0, [threading.Thread(target=worker, args=(seed,)) for seed in range(8)], stop)
    assert not errors, errors[:3]
    assert_consistent(table, "after the threads")
    table.free(sorted(table.known_ids()))
    assert_consistent(table, "emptied")
    assert len(table) == 0 and table.usage()[3] == 0


# ---- plan_sync with a live holds() ----------------------------------------------------------------
def test_plan_sync_asks_only_about_acks_and_graves() -> None:
    """holds() is asked for the ids the reply names, never for every object (the old signature took
    a set of all of them); a grave also expired, and a grave listed twice, are freed once."""
    asked: list[int] = []
    held = {1, 2, 3, 7}

    def holds(alloc_id: int) -> bool:
        asked.append(alloc_id)
        return alloc_id in held

    plan = plan_sync(expired=[2, 3], expired_status=["R", "G"], acked=[1, 3, 99], graves=[7, 2, 7, 8], holds=holds)
    assert plan.commit == (1, 3)
    assert plan.free == (2, 7)  # 3 is acked: kept; 8 is not held
    assert sorted(asked) == [1, 3, 7, 8, 99]


# ---- a real in-process agent ----------------------------------------------------------------------
def chunk_file(tmp_path: Path, seed: int) -> bytes:
    """A valid disk-tier chunk file (what a peer's disk spill sends)."""
    source = DiskTier(tmp_path / f"src-{seed}-{uuid.uuid4().hex[:6]}", 8 * MiB)
    try:
        data = (np.random.default_rng(seed).standard_normal(16 * KiB) * 0.05).astype(np.float16)
        source.write(1, memoryview(data.view(np.uint8)), itemsize=2)
        return source.read_blob(1)
    finally:
        source.close()


def all_tables_consistent(agent: Agent, where: str) -> None:
    for name, table in (("host", agent.table), ("inbox", agent.inbox.table if agent.inbox else None)):
        if table is not None:
            assert_consistent(table, f"{where} ({name})")


def test_agent_tables_stay_consistent_through_puts_spills_in_and_syncs(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client], tmp_path: Path
) -> None:
    agent = make_inproc_agent(
        host_bytes=8 * MiB, reserve_timeout_s=0.5, disk_path=str(tmp_path / "disk"), disk_bytes=64 * MiB
    )
    assert agent.inbox is not None and agent.disk is not None
    client = clients(agent, lease_ms=1, transports=("shm", "tcp"))
    tcp_only = clients(agent, lease_ms=1, transports=("tcp",))
    rng = np.random.default_rng(5)
    values = {f"k{i}": rng.integers(0, 256, int(rng.integers(1, 32 * KiB)), dtype=np.uint8) for i in range(60)}
    client.put_many(dict(list(values.items())[:30]))
    for key, value in list(values.items())[30:]:
        tcp_only.put(key, value)  # TCP WRITEs: fenced by the agent while they arrive
    agent.sync_once()
    all_tables_consistent(agent, "after the puts")
    assert agent.table.usage()[3] == 60

    # Replace half, remove a quarter: graves; the sync frees them once their (1 ms) leases end.
    for i in range(0, 30):
        client.put(f"k{i}", values[f"k{i}"][::-1].copy())
    client.remove_many([f"k{i}" for i in range(30, 45)])
    assert wait_until(lambda: (agent.sync_once(), agent.table.usage()[3] == 45)[1], 5), agent.table.usage()

    # Abandoned reservations (a RESERVE, then nothing, or a FREE): expired, asked about, freed.
    peer = PeerConnections(agent.server.endpoint, timeout_s=5, max_idle=2)
    try:
        peer.reserve([(4 * KiB, uuid.uuid4().bytes) for _ in range(5)], node_id=agent.node_id)
        dropped = peer.reserve([(4 * KiB, uuid.uuid4().bytes) for _ in range(3)], node_id=agent.node_id)
        assert peer.free([r.alloc_id for r in dropped]) == 3
        all_tables_consistent(agent, "with reservations in flight")
        assert len(agent.table.reserved_deadlines()) == 8

        # Two disk spills in: one written and swapped (acked: it becomes a disk allocation known
        # by its key), one written and given up (freed with its file).
        blob = chunk_file(tmp_path, 1)
        put_ids = [uuid.uuid4().bytes, uuid.uuid4().bytes]
        agent.index.guard_reservations([p.hex() for p in put_ids], node_id=agent.node_id, ttl_ms=60_000)
        kept, abandoned = peer.reserve(
            [(len(blob), p) for p in put_ids], node_id=agent.node_id, tier=TIER_DISK, flags=SPILL_FLAG
        )
        for res in (kept, abandoned):
            peer.write(res.alloc_id, res.offset, memoryview(blob))
        all_tables_consistent(agent, "spills written")
        assert agent.holds(kept.alloc_id) and agent.holds(abandoned.alloc_id)
        # The object the kept file now holds: moved there from k0's host replica.
        meta = client.object_meta("k0")
        assert meta is not None
        new = Replica(
            node_id=agent.node_id,
            tier=TierKind.DISK,
            offset=0,
            size_bytes=meta.size_bytes,
            alloc_id=kept.alloc_id,
            state=ReplicaState.COMPLETE,
        )
        (status,) = agent.index.move_replicas(
            [("k0", meta.replicas[0].alloc_id, new, put_ids[0].hex())], old_node=agent.node_id
        )
        assert status == "OK"
        assert peer.free([abandoned.alloc_id]) == 1
    finally:
        peer.close()

    def settled() -> bool:
        agent.sync_once()
        return not agent.table.reserved_deadlines() and len(agent.inbox.table) == 0

    assert wait_until(settled, 5), (agent.table.reserved_deadlines(), agent.inbox.table.known_ids())
    all_tables_consistent(agent, "settled")
    assert agent.disk_keys.get(kept.alloc_id) == "k0" and agent.holds(kept.alloc_id)
    assert not agent.holds(abandoned.alloc_id) and abandoned.alloc_id not in agent.disk
    # k0's old host block went to the graveyard; the count follows once it is freed.
    assert wait_until(lambda: (agent.sync_once(), agent.table.usage()[3] == 44)[1], 5), agent.table.usage()
    assert agent.tiers()[0].objects == 44

    # Everything removed: every table and the disk empty, the counts at zero.
    client.remove_many([k for k in values if client.object_meta(k) is not None])

    def emptied() -> bool:
        agent.sync_once()
        return len(agent.table) == 0 and not agent.disk_keys

    assert wait_until(emptied, 5), (len(agent.table), agent.disk_keys)
    all_tables_consistent(agent, "emptied")
    assert agent.table.usage()[3] == 0 and agent.disk.objects == 0


def test_syncs_racing_puts_reads_and_removes_leave_no_drift_and_no_leak(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """The sync (now asking holds() per id) runs in a loop while writers, readers and removers work
    through the agent's server threads: afterwards every allocation is an object the index names,
    and the running count is the number of those objects."""
    agent = make_inproc_agent(host_bytes=16 * MiB, reserve_timeout_s=0.3, sync_interval_s=0.01)
    stop = threading.Event()
    errors: list[BaseException] = []

    def syncer() -> None:
        while not stop.is_set():
            try:
                agent.sync_once()
            except BaseException as exc:
                errors.append(exc)
                return

    def writer(seed: int, transports: tuple[str, ...]) -> None:
        c = clients(agent, lease_ms=1, transports=transports)
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                key = f"w{seed}/{int(rng.integers(40))}"
                if rng.random() < 0.7:
                    # A put whose every try outlived the 0.3 s reservations (a loaded machine) gives
                    # up, as it should: what is checked is that nothing drifts or leaks meanwhile.
                    with contextlib.suppress(ReservationExpired):
                        c.put(key, rng.integers(0, 256, int(rng.integers(1, 16 * KiB)), dtype=np.uint8))
                elif rng.random() < 0.5:
                    c.remove(key)
                else:
                    try:
                        c.get(key)
                    except Exception:
                        pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=syncer)]
    threads += [threading.Thread(target=writer, args=(s, t)) for s, t in ((1, ("shm", "tcp")), (2, ("tcp",)))]
    run_for(3.0, threads, stop)
    assert not errors, errors[:3]

    index = agent.index
    named = {
        r.alloc_id
        for key in index.redis.smembers(index.prefix + "nobj:" + agent.node_id)
        for r in (index.replicas_listed(key) or ())
        if r.node_id == agent.node_id
    }

    def quiet() -> bool:
        agent.sync_once()
        return not agent.table.reserved_deadlines() and agent.table.known_ids() == named

    assert wait_until(quiet, 5), (agent.table.known_ids() - named, named - agent.table.known_ids())
    assert_consistent(agent.table, "quiet")
    assert agent.table.usage()[3] == len(named)


def test_an_ack_for_a_put_made_after_the_deadlines_were_taken_commits(
    make_inproc_agent: Callable[..., Agent],
) -> None:
    """A whole put (reserve, put_start, put_commit) lands after the sync read its reservations'
    deadlines and before its round trip: the reply's ack is drained now and never comes again, so
    the plan's holds() must see the new reservation and the table must count it committed."""
    agent = make_inproc_agent(reserve_timeout_s=30.0)
    real_sync = agent.index.agent_sync
    made: list[int] = []

    def put_then_sync(*args: Any, **kwargs: Any) -> Any:
        if not made:
            put_id = uuid.uuid4().bytes
            (alloc,) = agent.table.reserve([(KiB, put_id)]) or []
            made.append(alloc.alloc_id)
            replica = Replica(
                node_id=agent.node_id,
                tier=TierKind.HOST,
                offset=alloc.offset,
                size_bytes=KiB,
                alloc_id=alloc.alloc_id,
                state=ReplicaState.PENDING,
            )
            agent.index.put_start(
                [
                    PendingPut(
                        put_id=put_id.hex(),
                        key="late",
                        size_bytes=KiB,
                        dtype="uint8",
                        shape=(KiB,),
                        checksum=0,
                        replicas=(replica,),
                    )
                ],
                ttl_ms=60_000,
            )
            assert agent.index.put_commit([put_id.hex()]) == ["OK"]
        return real_sync(*args, **kwargs)

    agent.index.agent_sync = put_then_sync  # type: ignore[method-assign]
    try:
        agent.sync_once()
    finally:
        agent.index.agent_sync = real_sync  # type: ignore[method-assign]
    assert_consistent(agent.table, "after the sync")
    assert agent.table.usage()[3] == 1 and not agent.table.reserved_deadlines()
    agent.sync_once()  # nothing comes again, nothing changes
    assert agent.table.usage()[3] == 1 and agent.table.known_ids() == set(made)


# ---- nothing per request visits every allocation --------------------------------------------------
class CountingAllocs(dict):  # type: ignore[type-arg]
    """The table's allocation dict, counting how many allocations whole-table walks visit."""

    visited = 0

    def _walked(self) -> None:
        type(self).visited += len(self)

    def __iter__(self) -> Iterator[Any]:
        self._walked()
        return super().__iter__()

    def values(self) -> Any:
        self._walked()
        return super().values()

    def items(self) -> Any:
        self._walked()
        return super().items()

    def keys(self) -> Any:
        self._walked()
        return super().keys()


def test_reserve_sync_heartbeat_and_usage_visit_no_allocation(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    objects = 3000

    def instrument(agent: Agent) -> None:
        agent.table._allocs = CountingAllocs()

    agent = make_inproc_agent(host_bytes=32 * MiB, reserve_timeout_s=30.0, prepare=instrument)
    client = clients(agent, transports=("tcp",))
    client.put_many({f"o{i}": np.full(64, i % 251, np.uint8) for i in range(objects)})
    agent.sync_once()
    assert agent.table.usage()[3] == objects
    CountingAllocs.visited = 0
    for i in range(20):  # RESERVE (+ the watermark check after it), WRITE, the commit's ack, READ
        client.put(f"n{i}", np.full(64, 7, np.uint8))
        client.get(f"o{i}")
    for _ in range(10):
        agent.sync_once()
        agent.tiers()  # what every heartbeat publishes
        agent.table.usage()
        agent.table.reserved_deadlines()
        agent.holds(10**15)
    assert CountingAllocs.visited == 0, (
        f"{CountingAllocs.visited} allocation visits for 20 puts, 20 gets, 10 syncs and heartbeats with "
        f"{objects} objects: something walks the whole table per request"
    )
    assert agent.table.usage()[3] == objects + 20
