"""Warnings of a background duty that fails again and again: a streak is told at its start, then
at most once per interval with the count since, and at its end (with the index gone an agent wrote
~7 lines a second)."""

from __future__ import annotations

import logging
import time

import pytest

from mooncake_store.agent.failure_log import FailureLog


def test_a_streak_is_one_warning_then_a_count_then_its_end(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("mooncake.test.failure_log")
    failures = FailureLog(log, "sync", every_s=3600.0)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(100):
            failures.failed(ConnectionError("index unreachable"))
        failures.succeeded()
        failures.succeeded()  # no streak: nothing to say
        failures.failed(ConnectionError("again"))
    assert [r.getMessage() for r in caplog.records] == [
        "sync failed: index unreachable",
        "sync works again, after 100 failures in a row",
        "sync failed: again",
    ]


def test_a_long_streak_is_told_again_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("mooncake.test.failure_log")
    failures = FailureLog(log, "heartbeat", every_s=0.2)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for name in "abcde":  # within microseconds: one warning
            failures.failed(ConnectionError(name))
        time.sleep(0.25)  # the interval has passed: the next one is told, with the count
        failures.failed(ConnectionError("f"))
    assert [r.getMessage() for r in caplog.records] == [
        "heartbeat failed: a",
        "heartbeat failed: f (4 more failures since the last warning)",
    ]


def test_a_routine_streak_is_told_at_its_own_level(caplog: pytest.LogCaptureFixture) -> None:
    # A peer's refusals (agent/spill.py): at INFO, where a repair asked every second said each one.
    log = logging.getLogger("mooncake.test.failure_log")
    refusals = FailureLog(log, "spill to n2", every_s=0.2, level=logging.INFO)
    with caplog.at_level(logging.INFO, logger=log.name):
        for n in range(3):
            refusals.failed(f"1 object(s) refused: no room ({n})")
        time.sleep(0.25)
        refusals.failed("1 object(s) refused: no room (3)")
        refusals.succeeded()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "spill to n2 failed: 1 object(s) refused: no room (0)"),
        (logging.INFO, "spill to n2 failed: 1 object(s) refused: no room (3) (2 more failures since the last report)"),
        (logging.INFO, "spill to n2 works again, after 4 failures in a row"),
    ]
