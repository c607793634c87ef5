"""Small helpers shared by the test modules (tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last answer either way."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
