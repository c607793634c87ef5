"""What the pressure loop (agent/pressure.py) keeps between its passes: the room writers whose
reservations did not fit wait for (RoomRequests), and per tier whether a drain is under way and
whether it backs off, with the hold on the loop's wakes after a pass that found nothing movable
(Drains)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mooncake_store.config.tree import AgentConfig
from mooncake_store.policy.eviction import bytes_to_free
from mooncake_store.types import TierKind

#: After a pass that found nothing movable, granted reservations wake the loop again only after
#: this long (or the interval, if shorter): a writer filling a node of pinned or leased objects
#: costs the index at most one victim sample per retry, not one per put, and pins released
#: meanwhile are acted on at its end rather than at the next interval (a reservation that does
#: not fit still wakes the loop at once).
FRUITLESS_RETRY_S = 0.02
#: A drain between a tier's watermarks whose passes find nothing movable (pinned or hot objects)
#: retries after the interval, then twice as long after each such pass, up to this: each pass is
#: a victim sample the index runs, and a node held there by its pins sampled five times a second
#: for as long as they lasted. Past the high watermark, or with a writer waiting, no pass waits.
DRAIN_RETRY_MAX_S = 2.0
#: A reservation refused this long ago may still have its writer waiting for room: a put asks
#: again after a back-off of at most 1 s (client/puts.py), and this covers that and its round trip.
WRITER_WAITS_S = 2.0

#: The tiers whose room a reservation may wait for: a disk's room is made by its own passes only.
ARENA_TIERS = (TierKind.HOST, TierKind.GPU)


class RoomRequests:
    """Per arena tier (host, GPU): the largest reservation that did not fit since a pass last
    took the request, the marks of the peers where the writers waiting for room there keep their
    puts' other replicas (frames.spared_peers: a pass spills nothing to those), and when a
    reservation there last did not fit. Server threads note; the pressure thread takes. ``clock``:
    monotonic seconds (a test turns its own)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: The blocks (footprints) of the largest refused reservation per tier; () for none.
        self.wanted: dict[TierKind, tuple[int, ...]] = dict.fromkeys(ARENA_TIERS, ())
        self.spared: dict[TierKind, int] = dict.fromkeys(ARENA_TIERS, 0)
        self._refused_at: dict[TierKind, float] = dict.fromkeys(ARENA_TIERS, -WRITER_WAITS_S)

    def refused(self, tier: TierKind, blocks: tuple[int, ...], spared_peers: int) -> None:
        """A reservation of ``blocks`` in ``tier`` did not fit; its writer waits for room."""
        self._refused_at[tier] = self._clock()
        self.note(tier, blocks, spared_peers)

    def note(self, tier: TierKind, blocks: tuple[int, ...], spared_peers: int = 0) -> None:
        """Ask the next pass over ``tier`` for room for ``blocks`` (given back by a pass that
        failed or made too little); of two writers waiting, the larger reservation."""
        with self._lock:
            if sum(blocks) > sum(self.wanted[tier]):
                self.wanted[tier] = blocks
            self.spared[tier] |= spared_peers

    def take(self, tier: TierKind) -> tuple[tuple[int, ...], int]:
        """(wanted blocks, spared peers' marks) for a pass over ``tier``, cleared."""
        with self._lock:
            wanted, self.wanted[tier] = self.wanted[tier], ()
            spared, self.spared[tier] = self.spared[tier], 0
        return wanted, spared

    def pending(self) -> bool:
        """Whether any writer's request waits for a pass."""
        with self._lock:
            return any(self.wanted.values())

    def writer_may_wait(self, tier: TierKind) -> bool:
        """Whether a reservation in ``tier`` was refused within WRITER_WAITS_S."""
        return self._clock() - self._refused_at[tier] < WRITER_WAITS_S


class Drains:
    """Per tier, whether a drain is under way (it passed its high watermark and is not yet under
    its low one) and whether that drain backs off (its last pass found nothing movable); and until
    when the loop holds its wakes after such a pass (``fruitless_until``, in ``clock``'s seconds:
    monotonic ones, but in a test that turns its own)."""

    def __init__(self, config: AgentConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()  # the pressure thread, and in-process callers of its passes
        self._draining: set[TierKind] = set()
        #: Per tier whose last pass found nothing movable: that pass's back-off and until when
        #: (monotonic s) its drain between the watermarks waits for the next. Gone once a pass
        #: moves something, or the drain ends.
        self._backoff: dict[TierKind, tuple[float, float]] = {}
        self.fruitless_until = 0.0

    def need(self, tier: TierKind, used: int, capacity: int, wanted: int = 0) -> int:
        """Bytes to move out of ``tier`` now. Past the high watermark a drain starts and goes on,
        pass after pass, until the tier is under its low watermark: one pass samples a bounded
        number of objects, which may leave it between the two, and a pass may find nothing movable
        yet (pinned or leased objects, movable later)."""
        cfg = self._config
        with self._lock:
            over_high = used > cfg.high_watermark * capacity
            if over_high:
                self._draining.add(tier)
            elif used <= cfg.low_watermark * capacity:
                self._draining.discard(tier)
                self._backoff.pop(tier, None)
            draining = tier in self._draining
            if draining and not over_high and not wanted and self._backing_off(tier, self._clock()):
                return 0  # a drain held up by unmovable objects: its next pass is due later
        return bytes_to_free(
            used, capacity, high=cfg.high_watermark, low=cfg.low_watermark, wanted_bytes=wanted, draining=draining
        )

    def moved(self, tier: TierKind) -> None:
        """A pass over ``tier`` moved something: no hold, no back-off."""
        self.fruitless_until = 0.0
        with self._lock:
            self._backoff.pop(tier, None)

    def fruitless(self, tier: TierKind) -> None:
        """A pass over ``tier`` found nothing movable (all hot, pinned or leased). Its drain goes on,
        for those objects become movable later: ended here, it left the tier between its watermarks
        for good once they could, as nothing would start another drain. Between the watermarks its
        passes back off (need): the interval, then twice as long each time, up to
        DRAIN_RETRY_MAX_S. The loop holds its wakes for FRUITLESS_RETRY_S."""
        now = self._clock()
        interval = self._config.pressure_interval_s
        self.fruitless_until = now + min(FRUITLESS_RETRY_S, interval)
        with self._lock:
            last = self._backoff.get(tier)
            backoff = min(DRAIN_RETRY_MAX_S, 2 * last[0]) if last else interval
            self._backoff[tier] = (backoff, now + backoff)

    def hold_s(self) -> float:
        """How much longer the loop holds its wakes (<= 0: none)."""
        return self.fruitless_until - self._clock()

    def running(self) -> set[TierKind]:
        """The tiers draining whose next pass is not held back: their passes run this wake."""
        now = self._clock()
        with self._lock:
            return {t for t in self._draining if not self._backing_off(t, now)}

    def _backing_off(self, tier: TierKind, now: float) -> bool:
        """Whether ``tier``'s drain waits out its back-off (under self._lock)."""
        backoff = self._backoff.get(tier)
        return backoff is not None and now < backoff[1]
