"""The pressure loop's state between passes (agent/drains.py) on a clock the test turns: when a
drain starts, goes on and ends, how its passes back off after finding nothing movable, and the
room writers wait for. The loop itself, with real agents, is tested in
tests/integration/test_drain_outlives_fruitless_pass.py and test_pressure_wakes.py."""

from __future__ import annotations

import pytest

from mooncake_store.agent.drains import DRAIN_RETRY_MAX_S, FRUITLESS_RETRY_S, WRITER_WAITS_S, Drains, RoomRequests
from mooncake_store.config.tree import AgentConfig
from mooncake_store.types import TierKind

CAP = 1000  # a tier of 1000 bytes: high watermark 900, low 750
HOST, DISK = TierKind.HOST, TierKind.DISK


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def drains(clock: Clock) -> Drains:
    config = AgentConfig(high_watermark=0.9, low_watermark=0.75, pressure_interval_s=0.2)
    return Drains(config, clock=clock)


def test_a_drain_starts_past_the_high_watermark_and_ends_under_the_low_one(drains: Drains) -> None:
    assert drains.need(HOST, 900, CAP) == 0  # at the high watermark: no drain
    assert drains.need(HOST, 950, CAP) == 200  # past it: down to the low one
    assert drains.running() == {HOST}
    # Between the watermarks the drain goes on, pass after pass.
    assert drains.need(HOST, 800, CAP) == 50
    assert drains.need(HOST, 751, CAP) == 1
    assert drains.need(HOST, 750, CAP) == 0  # under the low one: over
    assert drains.running() == set()
    assert drains.need(HOST, 800, CAP) == 0  # and between them again, no drain starts
    assert drains.need(DISK, 800, CAP) == 0  # each tier has its own


def test_a_waiting_writer_is_room_wanted_below_the_high_watermark(drains: Drains) -> None:
    # 300 wanted with 200 free: 100 must go, though the tier is under its high watermark.
    assert drains.need(HOST, 800, CAP, wanted=300) == 100
    assert drains.running() == set()  # a writer's room is no drain


def test_a_fruitless_pass_backs_the_drain_off_doubling_up_to_the_bound(drains: Drains, clock: Clock) -> None:
    assert drains.need(HOST, 950, CAP) > 0
    waits: list[float] = []
    for _ in range(6):
        drains.fruitless(HOST)
        start = clock.now
        # Between the watermarks the next pass waits out the back-off ...
        assert drains.need(HOST, 800, CAP) == 0
        assert drains.running() == set()  # a drain backing off runs no pass now (chain eviction)
        # ... but not past the high watermark, nor with a writer waiting.
        assert drains.need(HOST, 950, CAP) == 200
        assert drains.need(HOST, 800, CAP, wanted=300) == 100
        step = 0.01
        while drains.need(HOST, 800, CAP) == 0:
            clock.now += step
            assert clock.now - start <= DRAIN_RETRY_MAX_S + step, "the back-off outlived its bound"
        waits.append(clock.now - start)
        assert drains.running() == {HOST}
    assert waits == pytest.approx([0.2, 0.4, 0.8, 1.6, DRAIN_RETRY_MAX_S, DRAIN_RETRY_MAX_S], abs=0.011)


def test_a_pass_that_moves_something_ends_the_back_off(drains: Drains, clock: Clock) -> None:
    drains.need(HOST, 950, CAP)
    for _ in range(3):
        drains.fruitless(HOST)
    drains.moved(HOST)
    assert drains.need(HOST, 800, CAP) == 50  # no wait
    drains.fruitless(HOST)  # and the next fruitless pass starts again from the interval
    clock.now += 0.21
    assert drains.need(HOST, 800, CAP) == 50


def test_a_drain_that_ends_forgets_its_back_off(drains: Drains, clock: Clock) -> None:
    drains.need(HOST, 950, CAP)
    for _ in range(4):
        drains.fruitless(HOST)  # 1.6 s
    assert drains.need(HOST, 700, CAP) == 0  # under the low watermark: over
    assert drains.need(HOST, 950, CAP) == 200  # a new drain
    drains.fruitless(HOST)
    clock.now += 0.21  # the interval, not 2 x 1.6 s
    assert drains.need(HOST, 800, CAP) == 50


def test_the_loop_holds_its_wakes_briefly_after_a_fruitless_pass(drains: Drains, clock: Clock) -> None:
    assert drains.hold_s() <= 0
    drains.fruitless(HOST)
    assert drains.hold_s() == pytest.approx(FRUITLESS_RETRY_S)
    clock.now += FRUITLESS_RETRY_S
    assert drains.hold_s() <= 0
    drains.fruitless(HOST)
    drains.moved(DISK)  # any pass that moves something ends the hold
    assert drains.hold_s() <= 0


def test_room_requests_are_the_largest_wait_and_every_spared_peer_until_taken(clock: Clock) -> None:
    requests = RoomRequests(clock=clock)
    assert not requests.pending() and not requests.writer_may_wait(HOST)
    requests.refused(HOST, (100, 200), 0b01)
    requests.refused(HOST, (250,), 0b10)  # a smaller reservation: the batch of 300 B stays wanted
    assert requests.pending() and requests.writer_may_wait(HOST)
    assert not requests.writer_may_wait(TierKind.GPU)
    assert requests.take(HOST) == ((100, 200), 0b11)
    assert requests.take(HOST) == ((), 0) and not requests.pending()
    requests.note(HOST, (300,), 0b01)  # a pass that made too little gives the request back
    assert requests.take(HOST) == ((300,), 0b01)
    clock.now += WRITER_WAITS_S
    assert not requests.writer_may_wait(HOST)  # the writer has asked again, or given up
