"""What an agent does with the answer of its sync round trip: which allocations became objects,
which to free. Pure, so the reclaim rules are unit-tested without Redis."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncPlan:
    commit: tuple[int, ...]  # reservations that are now objects
    free: tuple[int, ...]  # allocations to release (revoked, abandoned or buried past their lease)


def expired_reservations(reserved_deadlines: Mapping[int, float], now: float) -> list[int]:
    """Alloc ids of reservations whose deadline (monotonic seconds) has passed."""
    return sorted(alloc for alloc, deadline in reserved_deadlines.items() if deadline <= now)


def plan_sync(
    *,
    expired: Sequence[int],
    expired_status: Sequence[str],
    acked: Iterable[int],
    graves: Iterable[int],
    holds: Callable[[int], bool],
) -> SyncPlan:
    """Decide from one agent_sync answer.

    - An ack turns a reservation into an object (commit).
    - An expired reservation whose pending record the sync revoked ("R") is freed: its put will fail.
    - An expired reservation whose record was already gone ("G") and that is not acked was revoked
      by its writer (or never recorded, the writer died first): freed.
    - A grave is freed if the agent still knows it (a grave for an unknown id was freed earlier).

    ``holds(alloc_id)`` says whether the agent holds an id; it is asked per id (the agent's tables
    are not copied into a set of every object each sync).
    """
    # Every ack of an allocation the agent holds commits it, even one reserved after the sync took
    # its snapshot (an ack may also come twice, after a lost reply: committing again is harmless).
    acked_set = {a for a in acked if holds(a)}
    commit = tuple(sorted(acked_set))
    free: list[int] = []
    for alloc, status in zip(expired, expired_status, strict=True):
        if status == "R" or (status == "G" and alloc not in acked_set):
            free.append(alloc)
    freeing = set(free)
    for grave in graves:
        if grave not in freeing and holds(grave):
            free.append(grave)
            freeing.add(grave)
    return SyncPlan(commit=commit, free=tuple(free))
