"""Warnings of a background duty that fails again and again (the index unreachable: every
heartbeat, sync and pressure pass fails). Each failed call was a warning: with the index gone an
agent wrote ~7 lines a second, which buried what came before. Now a streak is told at its start,
then at most once per ``every_s`` with the count since, and at its end."""

from __future__ import annotations

import logging
import threading
import time


class FailureLog:
    """``level``: what the streak is told at (a peer's refusals, routine, at INFO)."""

    def __init__(self, log: logging.Logger, what: str, *, every_s: float = 30.0, level: int = logging.WARNING) -> None:
        self._log = log
        self._what = what
        self._every_s = every_s
        self._level = level
        self._lock = threading.Lock()
        self._streak = 0  # failures in a row
        self._unsaid = 0  # of those, not yet in a warning
        self._said_at = 0.0

    def failed(self, error: BaseException | str) -> None:
        with self._lock:
            self._streak += 1
            now = time.monotonic()
            if self._streak > 1 and now - self._said_at < self._every_s:
                self._unsaid += 1
                return
            told = "warning" if self._level >= logging.WARNING else "report"
            since = f" ({self._unsaid} more failures since the last {told})" if self._unsaid else ""
            self._unsaid, self._said_at = 0, now
        self._log.log(self._level, "%s failed: %s%s", self._what, error, since)

    def succeeded(self) -> None:
        with self._lock:
            streak, self._streak, self._unsaid = self._streak, 0, 0
        if streak > 1:
            self._log.log(self._level, "%s works again, after %d failures in a row", self._what, streak)
