"""The agent's sync with the index (agent_sync.lua, one round trip): commits of acked reservations,
frees of expired ones and of due graves, and the count of spills that landed here; on its own
loop, and on demand before a reservation is refused (reclaim_now). A mixin of Agent, kept apart
so that node.py stays the agent's wiring and life cycle; it uses only the attributes declared
below, which Agent sets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mooncake_store.agent.failure_log import FailureLog
from mooncake_store.errors import MooncakeError
from mooncake_store.index.node_table import IndexWentBack
from mooncake_store.policy.reclaim import expired_reservations, plan_sync
from mooncake_store.transport.frames import TIER_DISK, TIER_GPU
from mooncake_store.types import TierKind

if TYPE_CHECKING:
    from mooncake_store.agent.allocations import AllocationTable
    from mooncake_store.agent.inbox import DiskInbox
    from mooncake_store.agent.pressure import PressureManager
    from mooncake_store.config import AgentConfig
    from mooncake_store.index import RedisIndex

log = logging.getLogger("mooncake.agent")

#: Reclaims on demand (before refusing a reservation) at most this often.
RECLAIM_MIN_INTERVAL_S = 0.02
#: Expired reservations one sync takes to the index; the rest go with the next syncs.
MAX_EXPIRED_PER_SYNC = 4096


class SyncDuties:
    config: AgentConfig
    node_id: str
    incarnation: str
    index: RedisIndex
    disk_keys: dict[int, str]
    inbox: DiskInbox | None
    pressure: PressureManager
    _stop: threading.Event
    index_timeout_s: float

    def _init_sync_state(self) -> None:
        """This mixin's own state, set by Agent's constructor."""
        self._sync_lock = threading.Lock()
        #: Spill reservations granted to peers and not yet landed or freed, with their tier.
        self._spills_in_flight: dict[int, TierKind] = {}
        self._spills_lock = threading.Lock()
        #: Whether the last sync's reply arrived and was applied (agent_sync.lua keeps its acks and
        #: graves until the next sync says so). True at start: nothing came before.
        self._sync_applied = True
        self._last_reclaim = 0.0
        #: Syncs finished so far, under _synced: a reclaim that finds a sync under way waits for its end.
        self._syncs_done = 0
        self._synced = threading.Condition()
        #: The node record's count of this agent's heartbeats and syncs, as last answered: it only
        #: grows while the index keeps its data (node_heartbeat.lua, agent_sync.lua).
        self._beats = 0
        self._beats_lock = threading.Lock()
        #: Set to have the heartbeat loop beat now (a sync found the index gone back), or to stop.
        self._beat_now = threading.Event()

    if TYPE_CHECKING:  # Agent's own

        def _tables(self) -> list[AllocationTable]: ...
        def holds(self, alloc_id: int) -> bool: ...
        def free_allocations(self, alloc_ids: list[int] | tuple[int, ...]) -> None: ...
        def drop_settled_corrupt(self, alloc_id: int) -> None: ...

    def _note_count(self, count: int) -> None:
        with self._beats_lock:
            self._beats = max(self._beats, count)

    def reclaim_now(self, *, force: bool = False) -> None:
        """Free what is due in the graveyard now, not at the next sync. ``force``: even right after
        another reclaim (a pressure pass that just moved objects out wants their room at once)."""
        # A client hammering a full agent must not turn every refused RESERVE into a Redis call.
        now = time.monotonic()
        if not force and now - self._last_reclaim < RECLAIM_MIN_INTERVAL_S:
            return
        self._last_reclaim = now
        try:
            if force:
                self.sync_once()
            else:
                self._sync_unless_under_way()
        except (MooncakeError, OSError) as exc:  # OSError: a chunk file's removal; not the caller's
            log.info("reclaim before refusing a reservation failed: %s", exc)

    def _sync_unless_under_way(self) -> None:
        """A sync now, or, when one is under way, the end of that one, which frees what is due as
        well (bounded by the index's timeout). Refused reservations (connection threads) queued a
        sync each behind the one holding the lock, each a round trip: with the index slow, the
        k-th waited k of them and its client timed out."""
        with self._synced:
            seen = self._syncs_done
        if self._sync_lock.acquire(blocking=False):
            try:
                self._synced_once()
            except IndexWentBack:
                self._beat_now.set()  # as in sync_once
            finally:
                self._sync_lock.release()
            return
        with self._synced:
            self._synced.wait_for(lambda: self._syncs_done != seen, timeout=self.index_timeout_s)

    def spill_reserved(self, alloc_ids: list[int], tier: int) -> None:
        kind = TierKind.DISK if tier == TIER_DISK else TierKind.GPU if tier == TIER_GPU else TierKind.HOST
        with self._spills_lock:
            self._spills_in_flight.update(dict.fromkeys(alloc_ids, kind))

    def _count_spills_in(self, committed: Iterable[int], freed: Iterable[int]) -> None:
        """Spills in are counted when their swaps land (the ack commits the reservation), not when
        the room was granted: a swap refused afterwards (the object changed meanwhile) moved nothing."""
        landed: Counter[TierKind] = Counter()
        with self._spills_lock:
            for alloc_id in committed:
                kind = self._spills_in_flight.pop(alloc_id, None)
                if kind is not None:
                    landed[kind] += 1
            for alloc_id in freed:
                self._spills_in_flight.pop(alloc_id, None)
        for kind, n in landed.items():
            self.pressure.count(kind, "spills_in", n)

    def _sync_loop(self) -> None:
        failures = FailureLog(log, "sync")
        while not self._stop.wait(self.config.sync_interval_s):
            try:
                self.sync_once()
                failures.succeeded()
            except MooncakeError as exc:  # unreachable, superseded, or a script error: try again
                failures.failed(exc)
            except Exception:  # a bug costs one sync, not the agent's reclaiming for good
                log.exception("sync failed unexpectedly")

    def sync_once(self) -> None:
        # One sync at a time: two could both see a reservation as expired, and the one that does not
        # get its (already drained) ack would free an object the other one just committed.
        try:
            with self._sync_lock:
                self._synced_once()
        except IndexWentBack:
            # Restored from an older snapshot: the sync drained nothing. The heartbeat loop beats
            # now rather than up to an interval later: the beat ends the node's deadline and the
            # agent reconciles (Agent._reconcile), on that thread, not on this caller's (a
            # connection's, asking for room).
            self._beat_now.set()

    def _synced_once(self) -> None:
        """One sync, under _sync_lock; those waiting for its end are told, however it ended."""
        try:
            self._sync_once()
        finally:
            with self._synced:
                self._syncs_done += 1
                self._synced.notify_all()

    def _sync_once(self) -> None:
        tables = self._tables()
        deadlines: dict[int, float] = {}
        for table in tables:
            deadlines.update(table.reserved_deadlines())
        # A slice per call: 200,000 expired at once held the index 0.35 s (a million: past the timeout).
        expired = expired_reservations(deadlines, time.monotonic())[:MAX_EXPIRED_PER_SYNC]
        put_ids = [next((t.put_id_of(a) for t in tables if a in t), None) or b"" for a in expired]
        put_ids_hex = [p.hex() for p in put_ids]
        # Until this reply is applied, the index keeps what it carries for the next sync.
        applied_last, self._sync_applied = self._sync_applied, False
        result = self.index.agent_sync(
            self.node_id,
            incarnation=self.incarnation,
            expired_put_ids=put_ids_hex,
            applied_last=applied_last,
            last_count=self._beats,
        )
        self._note_count(result.count)
        # Only now, with the index found current (not gone back to before the hold began).
        for table in tables:
            table.release_held()  # a reaped node's memory, once the leases on it ran out
        plan = plan_sync(
            expired=expired,
            expired_status=result.expired_status,
            acked=result.acked_alloc_ids,
            graves=result.graves,
            holds=self.holds,
        )
        for table in tables:
            table.commit(plan.commit)
        if self.inbox is not None:
            # Spilled chunk files whose swaps landed: disk allocations now, known by their keys.
            for alloc_id in self.inbox.settle(plan.commit):
                if alloc_id in result.acked_keys:
                    self.disk_keys[alloc_id] = result.acked_keys[alloc_id]
                    self.drop_settled_corrupt(alloc_id)  # if found damaged before its key was known
        if plan.free:
            self.free_allocations(plan.free)
        self._count_spills_in(plan.commit, plan.free)
        self._sync_applied = True
