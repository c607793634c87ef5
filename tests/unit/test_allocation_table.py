"""AllocationTable's committed count (usage()'s fourth field) is kept as a running count: it must
agree with the table's allocations after any mix of reserve, commit, free (at once or deferred
behind a reader or fence), expiry and the drop after a reap."""

from __future__ import annotations

import random
import time

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
            table.hold_reaped({})  # no lease runs on any of them: freed, or when their reads end
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


def test_after_a_reap_memory_is_held_while_read_leases_on_it_run() -> None:
    """drop_after_reap holds every object's memory until hold_reaped says how long the read leases
    on each run (same-host readers copy under them, unseen here); an object with no lease left is
    freed then, or when its TCP read ends; a reservation the index had committed is held too."""
    import time

    table = AllocationTable(1 << 20, reserve_timeout_s=60.0, alignment=64)
    a, b, c, d = (x.alloc_id for x in table.reserve([(4096, b"p")] * 4))  # type: ignore[union-attr]
    table.commit([a, b, c])  # d: committed in the index, its ack not yet drained here
    assert table.begin_read(c, *table.offset_of(c))  # type: ignore[misc]
    table.drop_after_reap()
    assert all(x in table for x in (a, b, c, d))  # nothing freed before the purge's answer
    assert table.free([a, b]) == 2 and a in table and b in table  # a grave for a held one waits too
    table.hold_reaped({b: 300, d: 300})
    assert a not in table  # no lease on it: freed
    assert b in table and d in table  # leased: held
    assert c in table  # no lease, but a TCP read moves it
    table.end_read(c)
    assert c not in table
    assert not table.begin_read(b, *table.offset_of(b))  # type: ignore[misc]  # held memory serves no read
    table.free([d])  # the sync frees the expired reservation: still held
    assert d in table and table.release_held() == 0
    time.sleep(0.35)
    assert table.release_held() == 2 and b not in table and d not in table
    assert table.usage()[0] == 0 and committed_by_scan(table) == table.usage()[3] == 0


def test_room_is_what_a_reservation_may_still_take_under_a_ceiling() -> None:
    """room() answers as reserve() decides: free space and its largest block, and with a ceiling
    (a peer's spill) no more than takes the use, in 64 B units, up to it."""
    table = AllocationTable(1 << 20, reserve_timeout_s=60.0)
    assert table.room() == (1 << 20, 1 << 20)
    table.reserve([(1000, b"a")])  # takes 1024 B of the arena
    assert table.room() == ((1 << 20) - 1024, (1 << 20) - 1024)
    assert table.room(ceiling_bytes=4096) == (3072, 3072)
    assert table.room(ceiling_bytes=512) == (0, 0)  # already past it
    free, _ = table.room(ceiling_bytes=4096)
    assert table.reserve([(free, b"b")], ceiling_bytes=4096) is not None  # exactly what it said
    assert table.reserve([(1, b"c")], ceiling_bytes=4096) is None


def test_after_the_index_lost_the_record_every_reservation_is_held_like_the_objects() -> None:
    """An index that came back empty named nothing (no purge): a reservation here may be an object
    it had committed and a reader leased before it went, the commit's ack not yet drained. Its
    memory was freed at the sync after the reap, and the next put took the block under the
    reader's copy. It is now held as long as the committed objects (at_least_ms); after a purge,
    which names the committed ones, the other reservations are freed at once, as before."""
    import time

    lost = AllocationTable(1 << 20, reserve_timeout_s=60.0, alignment=64)
    (r,) = (x.alloc_id for x in lost.reserve([(4096, b"p")]))  # type: ignore[union-attr]
    lost.drop_after_reap()
    assert lost.free([r]) == 1 and r in lost  # a sync before the new record's answer: held
    lost.hold_reaped({}, at_least_ms=300)  # no purge: held for a read lease
    assert r in lost
    lost.free([r])  # the sync frees the expired reservation: still held
    assert r in lost and lost.reserve([(1 << 20, b"q")]) is None  # its block is not handed out
    time.sleep(0.35)
    assert lost.release_held() == 1 and r not in lost
    purged = AllocationTable(1 << 20, reserve_timeout_s=60.0, alignment=64)
    (s,) = (x.alloc_id for x in purged.reserve([(4096, b"p")]))  # type: ignore[union-attr]
    purged.drop_after_reap()
    purged.hold_reaped({}, at_least_ms=0)  # a purge that found it uncommitted: a put in flight
    assert purged.free([s]) == 1 and s not in purged


def test_a_reaps_answer_never_cuts_an_earlier_hold_short() -> None:
    """hold_reaped set each held block to min(its hold, the purge's answer): after a purge, which
    lists only the leases the current index knows (at_least_ms 0), a block doomed by a rollback's
    reconcile, a reservation held after one, or a block held after an earlier loss of the index
    was freed at once, while readers that leased it from the earlier index could still copy it."""
    import time

    table = AllocationTable(1 << 20, reserve_timeout_s=60.0, alignment=64)
    doomed, reserved, lost = (x.alloc_id for x in table.reserve([(4096, b"p")] * 3))  # type: ignore[union-attr]
    table.commit([doomed, lost])
    assert table.doom([doomed], hold_ms=300) == 1  # the rollback's reconcile: held a lease
    table.hold_reservations(300)  # ... and the reservation with it
    table.drop_after_reap()  # then the index loses the record: held until told
    table.hold_reaped({}, at_least_ms=300)  # no purge: a lease for everything
    table.drop_after_reap()  # and a reap of the new record before that lease ran out
    table.hold_reaped({}, at_least_ms=0)  # a purge that knows no lease on any of them
    table.free([reserved])  # the sync frees the expired reservation
    assert {doomed, reserved, lost} <= table.known_ids(), "a hold was cut short by the purge's answer"
    assert table.release_held() == 0
    time.sleep(0.35)
    assert table.release_held() == 3 and not table.known_ids()


def test_expiring_counts_each_reservation_once_however_often_it_is_named() -> None:
    """A FREE frame naming one reservation twice (and ids never granted) answered 2: each mention of
    an id still RESERVED after its first was counted again."""
    table = AllocationTable(1 << 20, reserve_timeout_s=60.0, alignment=64)
    (res,) = table.reserve([(100, b"a")]) or []
    assert table.expire_now([res.alloc_id, res.alloc_id, 1, 2]) == 1
    assert table.reserved_deadlines()[res.alloc_id] <= time.monotonic()  # expired, not freed: the sync decides


def test_a_batch_is_placed_largest_first_as_fits_judges_it() -> None:
    """Free blocks of 4 and 6 units and a batch of 2, 4 and 4: in the batch's order the 2 took the
    4-unit hole and the second 4 found none, while fits() (largest first) said the batch fitted,
    and the pass waiting for it made no room (review, 2026-12-07)."""
    unit = 64
    table = AllocationTable(12 * unit, reserve_timeout_s=60.0, alignment=unit)
    layout = [
        a
        for size, name in ((4, b"hole"), (1, b"wall"), (6, b"end"), (1, b"tail"))
        for a in table.reserve([(size * unit, name)]) or []
    ]
    assert [a.offset // unit for a in layout] == [0, 4, 5, 11]
    table.free([layout[0].alloc_id, layout[2].alloc_id])
    batch = [(2 * unit, b"s"), (4 * unit, b"a"), (4 * unit, b"b")]
    assert table.fits(table.blocks_of(batch))
    granted = table.reserve(batch)
    assert granted is not None
    assert [a.put_id for a in granted] == [b"s", b"a", b"b"]  # in the batch's order all the same
    assert sorted(a.offset // unit for a in granted) == [0, 5, 9]
    assert granted[0].alloc_id < granted[1].alloc_id < granted[2].alloc_id
