"""What an agent does with the answer of its sync round trip: which allocations became objects,
which to free. Pure, so the reclaim rules are unit-tested without Redis."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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
    known: Iterable[int],
) -> SyncPlan:
    """Decide from one agent_sync answer.

    - An ack turns a reservation into an object (commit).
    - An expired reservation whose pending record the sync revoked ("R") is freed: its put will fail.
    - An expired reservation whose record was already gone ("G") and that is not acked was revoked
      by its writer (or never recorded, the writer died first): freed.
    - A grave is freed if the agent still knows it (a grave for an unknown id was freed earlier).
    """
    # Every ack of an allocation the agent holds commits it, even one reserved after the sync took
    # its snapshot (an ack may also come twice, after a lost reply: committing again is harmless).
    acked_set = set(acked) & set(known)
    commit = tuple(sorted(acked_set))
    free: list[int] = []
    for alloc, status in zip(expired, expired_status, strict=True):
        if status == "R" or (status == "G" and alloc not in acked_set):
            free.append(alloc)
    known_set = set(known)
    free.extend(g for g in graves if g in known_set and g not in free)
    return SyncPlan(commit=commit, free=tuple(free))
