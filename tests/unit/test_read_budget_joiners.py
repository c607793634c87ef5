"""ReadBudget.shared: a READ that joined another's copy while that one waited for the budget was
refused with it when the other's deadline came, though its own was later and the budget freed
before it (review, thirty-sixth session). It now waits out the rest of its own deadline."""

from __future__ import annotations

import threading
import time

from helpers import wait_until

from mooncake_store.agent.read_budget import OtherTierCopy, ReadBudget, SharedCopy
from mooncake_store.types import TierKind


def _copy() -> OtherTierCopy:
    return OtherTierCopy(bytearray(b"x" * 50), 0, TierKind.DISK)


def test_a_joiner_with_a_later_deadline_is_not_refused_with_the_maker() -> None:
    budget = ReadBudget(limit_bytes=100)
    assert budget.acquire(100, deadline=time.monotonic() + 1)  # another READ holds it all
    results: dict[str, tuple[bool, bool]] = {}

    def read(name: str, wait_s: float) -> None:
        with budget.shared(7, 50, deadline=time.monotonic() + wait_s, make=_copy) as held:
            results[name] = (held.busy, held.copy is not None)

    maker = threading.Thread(target=read, args=("maker", 1.0))
    maker.start()
    assert wait_until(lambda: 7 in budget._copies, 5.0)
    joiner = threading.Thread(target=read, args=("joiner", 30.0))
    joiner.start()
    assert wait_until(lambda: 7 in budget._copies and budget._copies[7].users == 2, 5.0), "no join"
    maker.join(10)
    assert results["maker"] == (True, False)  # refused: the budget stayed full past its deadline
    budget.release(100)  # the other READ's reply has gone
    joiner.join(30)
    assert results["joiner"] == (False, True), results
    assert budget.held_bytes == 0 and not budget._copies


def test_a_joiner_of_a_copy_that_could_not_be_made_gets_that_answer() -> None:
    """No such object (make() gives None): a joiner hears the same, at once, not a retry."""
    budget = ReadBudget(limit_bytes=100)
    made: list[int] = []
    gate = threading.Event()

    def make_none() -> OtherTierCopy | None:
        made.append(1)
        gate.wait(10)
        return None

    seen: list[SharedCopy] = []

    def read() -> None:
        with budget.shared(9, 50, deadline=time.monotonic() + 30, make=make_none) as held:
            seen.append(held)

    first = threading.Thread(target=read)
    first.start()
    assert wait_until(lambda: bool(made), 5.0)
    second = threading.Thread(target=read)
    second.start()
    assert wait_until(lambda: budget._copies[9].users == 2, 5.0)
    gate.set()
    first.join(10)
    second.join(10)
    assert len(made) == 1 and [(h.busy, h.copy) for h in seen] == [(False, None), (False, None)]
    assert budget.held_bytes == 0 and not budget._copies
