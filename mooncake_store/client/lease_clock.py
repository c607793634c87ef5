"""The clock a client budgets its read leases on.

A lease runs on the index's clock, which goes on while the reading host is suspended. The
monotonic clock stops then: a copy that spanned a suspend looked as quick as it was before it, and
a read that outlived its lease (its block freed and reused meanwhile) went unchecked.
CLOCK_BOOTTIME is monotonic too (no wall-clock step moves it) and counts the suspend. (The store
runs on Linux, which has it. A paused VM is covered by neither: its clocks stop with it.)
"""

from __future__ import annotations

import time


def lease_clock_s() -> float:
    """Seconds on the lease clock (an arbitrary origin): only differences mean anything."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)
