"""AllocationTable's committed count (usage()'s fourth field) is kept as a running count: it must
agree with the table's allocations after any mix of reserve, commit, free (at once or deferred
behind a reader or fence), expiry and the drop after a reap."""

from __future__ import annotations

import random

from mooncake_store.agent.allocations import AllocationTable, AllocState


def committed_by_scan(table: AllocationTable) -> int:
    with table._lock:
        return sum(1 for a in table._allocs.values() if a.state == AllocState.COMMITTED)


def test_committed_count_follows_every_transition() -> None:
    rng = random.Random(7)
    table = AllocationTable(1 << 20, reserve_timeout_s=60.0, alignment=64)
    reading: list[int] = []  # ids with a read (or fence) in progress
    for step in range(4000):
        ids = sorted(table.known_ids())
        op = rng.random()
        if op < 0.35 or not ids:
            table.reserve([(rng.randrange(0, 4096), b"p") for _ in range(rng.randrange(1, 5))])
        elif op < 0.6:
            table.commit(rng.sample(ids, min(len(ids), rng.randrange(1, 4))))  # committing twice counts once
        elif op < 0.75:
            table.free(rng.sample(ids, min(len(ids), rng.randrange(1, 4))))  # a read in progress defers it
        elif op < 0.85:
            alloc_id = rng.choice(ids)
            location = table.offset_of(alloc_id)
            if location is not None and table.begin_read(alloc_id, *location):
                reading.append(alloc_id)
        elif op < 0.95 and reading:
            table.end_read(reading.pop(rng.randrange(len(reading))))  # a doomed one is freed here
        elif op < 0.97:
            table.expire_now(rng.sample(ids, min(len(ids), 2)))
        else:
            table.drop_after_reap()
        assert table.usage()[3] == committed_by_scan(table), f"step {step}: running count drifted"
    for alloc_id in reading:
        table.end_read(alloc_id)
    table.free(sorted(table.known_ids()))
    assert table.usage()[3] == 0
    assert len(table) == 0


def test_reserve_that_does_not_fit_leaves_the_count_alone() -> None:
    table = AllocationTable(4096, reserve_timeout_s=60.0, alignment=64)
    (first,) = table.reserve([(1024, b"a")]) or []
    table.commit([first.alloc_id])
    assert table.reserve([(1024, b"b"), (1 << 20, b"c")]) is None  # all or nothing: rolled back
    assert table.usage()[3] == 1 == committed_by_scan(table)
