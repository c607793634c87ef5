"""Compaction of the host arena: objects moved inside it so that a block a reservation wanted appears.

A reservation refused for want of a block while the arena has the bytes free (its room in pieces)
asks for one here (AgentHooks.fragmented), whoever sent it: a writer, a peer's spill or repair, a
probe. The pressure loop then empties the cheapest window of that size (policy/compaction.py):
each object inside it is copied to a free block outside, in the same arena, and swapped there as
any move is (DESIGN.md §3.4: copy, compare-and-swap in the index, free the old block through the
graveyard), while the window's free pieces are held so that no reservation lands there meanwhile.
Nothing leaves the node, so none of this needs a peer or costs a copy of an object elsewhere: a peer
asked for a spill or a repair never makes room by pushing objects out (that is the pressure
passes' work, for its own writers), and before this its room in pieces stayed so. A repair to the
one peer left, 44% full in 1 MiB holes, left four of five 8 MiB objects one copy short for good.

Only the host arena is compacted; the GPU tier (a device copy per object) is not, and a disk tier
has no layout (a file per object).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake_store.agent.allocations import Allocation
from mooncake_store.policy.compaction import Block, choose_window, largest_first
from mooncake_store.types import EvictionCandidate

if TYPE_CHECKING:
    from mooncake_store.agent.moves import LocalMoves
    from mooncake_store.agent.node import Agent

log = logging.getLogger("mooncake.agent")

#: Objects of the tier read from the index per compaction, with what decides whether one may move
#: (pins, lease): all of them up to this many. An object not among them stays where it is.
SAMPLE = 4096
#: After a request for which no window could be emptied, further requests are put off this long:
#: a peer that retries a repair every second would otherwise cost the index a sample each time.
RETRY_S = 5.0
#: Blocks made per run at most (a reservation's batch may ask for up to frames.MAX_BATCH).
MAX_BLOCKS = 8
#: An object whose read lease runs longer than this past the run's start stays where it is.
LEASE_WAIT_S = 15.0
#: A held window is let go this long past LEASE_WAIT_S after its objects moved, joined or not.
HELD_SLACK_S = 2.0
#: How often an agent checks, between its passes, that its arena has free blocks for its largest
#: object (keep_blocks).
IDLE_CHECK_S = 5.0
#: After keep_blocks runs that made nothing (pinned objects, an outlier's size, long leases), its
#: checks back off, twice as long after each, up to this.
IDLE_CHECK_MAX_S = 120.0
#: Graves one sync frees at most (IndexClient.agent_sync's max_graves): a run that moved more
#: objects frees their old blocks in as many syncs.
GRAVES_PER_SYNC = 1000


@dataclass(slots=True)
class _HeldWindow:
    """A window emptied of objects some of which a reader still held under a lease: its free
    pieces stay held until the old blocks are freed (their graves fall due as the leases end), and
    then it is one block."""

    offsets: list[int]  # the held pieces (release_holds)
    held_bytes: int  # what they take: room on its way, not use (PressureManager._arena_need)
    old_ids: list[int]  # the moved objects' old blocks
    until: float = 0.0  # monotonic s: let go by then, joined or not (set once its objects moved)


class Compactor:
    def __init__(self, agent: Agent, moves: LocalMoves) -> None:
        self.agent = agent
        self.moves = moves
        self._lock = threading.Lock()
        self._wanted: list[int] = []  # the blocks the latest refusal asked for, largest first
        self._quiet_until = 0.0  # monotonic s: after a run that found no window
        # Windows waiting for their old blocks (the pressure thread's alone, as the runs are).
        self._held: list[_HeldWindow] = []
        self._next_idle_check = 0.0  # monotonic s: keep_blocks's next look
        self._idle_every = IDLE_CHECK_S  # keep_blocks's period, longer after runs that made nothing
        self._idle_asked = False  # the blocks wanted now are keep_blocks's, not a refusal's

    def want_blocks(self, blocks: list[int]) -> None:
        """A reservation of ``blocks`` (footprints) was refused while the arena had their bytes free."""
        capacity = self.agent.table.capacity_bytes
        wanted = sorted((size for size in blocks if 0 < size <= capacity), reverse=True)[:MAX_BLOCKS]
        with self._lock:
            self._wanted = wanted
            self._idle_asked = False

    def held_bytes(self) -> int:
        """What the held windows' pieces take: counted as used by the arena, they are room on its way."""
        with self._lock:
            return sum(held.held_bytes for held in self._held)

    def keep_blocks(self) -> None:
        """Ask for free blocks the size of the arena's largest object, as many as peers may spill
        into it (its room under its high watermark; MAX_BLOCKS at most), when its free pieces hold
        fewer: peers plan spills and repairs by the largest free block each node publishes, pass
        over a node none of whose pieces holds their victim (policy/eviction.py choose_move), and
        a batch of victims planned into its one block was refused whole. A cluster whose room was
        in pieces evicted objects while the bytes for them sat free. Looked at every IDLE_CHECK_S
        by the pressure loop (a walk over the arena's blocks); a run that finds no window puts
        the next off as a refusal's does."""
        now = time.monotonic()
        if now < self._next_idle_check or self._held:
            return
        self._next_idle_check = now + self._idle_every
        table = self.agent.table
        used = table.usage()[0]
        size = table.largest_object()
        room = int(self.agent.config.high_watermark * table.capacity_bytes) - used
        if size <= 0 or room < size:
            return  # nothing held, or no room a peer may fill: past its mark the passes move objects out
        count = min(MAX_BLOCKS, room // size)
        if table.free_blocks_of(size) < count:
            with self._lock:
                if not self._wanted:
                    # A block there already is the cheapest window (nothing to move): held, and the
                    # next one made elsewhere.
                    self._wanted = [size] * count
                    self._idle_asked = True

    def pending(self) -> bool:
        """Whether run_once has blocks to make (settle() lets held windows go: each loop calls it)."""
        with self._lock:
            return bool(self._wanted) and time.monotonic() >= self._quiet_until

    def run_once(self, stop: threading.Event | None = None) -> int:
        """Empty a window for each block the latest refusal asked for that the arena does not hold
        now, while there is one; returns the objects moved. ``stop``: the agent is stopping, and
        the run ends after the move under way (the arena goes soon after). While windows of an
        earlier run wait for their old blocks, no other is emptied: the writer's next try finds
        them joined."""
        if self.settle():
            return 0
        with self._lock:
            wanted, self._wanted = self._wanted, []
            idle, self._idle_asked = self._idle_asked, False
            if not wanted or time.monotonic() < self._quiet_until:
                return 0
        agent, table = self.agent, self.agent.table
        free, largest = table.room()
        if free < sum(wanted):
            return 0  # not there in any layout: the pressure passes make such room, for writers
        now_ms = agent.index.server_time_ms()
        # An object under a live read lease may move too: its old block stays in the graveyard
        # until the lease ends, and its window is held until then (_HeldWindow). Left in place,
        # an object any reader kept reading (each read renews its lease) was never moved, and a
        # writer waited out its timeout beside readers. Windows of objects free to go now are
        # chosen first; a lease longer than LEASE_WAIT_S keeps its object where it is.
        known = {
            c.alloc_id: c
            for c in agent.index.victim_candidates(agent.node_id, "host", sample=SAMPLE)
            if c.pins == 0 and c.lease_until_ms <= now_ms + LEASE_WAIT_S * 1000
        }

        def free_now(alloc: Allocation) -> bool:
            candidate = known.get(alloc.alloc_id)
            return candidate is not None and candidate.lease_until_ms <= now_ms

        def movable(alloc: Allocation) -> bool:
            return alloc.alloc_id in known

        made = 0
        moved: list[int] = []  # the old blocks of the objects moved: in the graveyard until freed
        windows: list[_HeldWindow] = []  # each block made is held until it joins: the next is made elsewhere
        try:
            for size in wanted:
                window = choose_window(table.layout(free_now), size) or choose_window(table.layout(movable), size)
                if window is None:
                    break
                pieces = table.hold_free_in(window.start, window.start + window.size)
                held = _HeldWindow(offsets=[o for o, _ in pieces], held_bytes=sum(n for _, n in pieces), old_ids=[])
                windows.append(held)
                held.old_ids = self._empty(window.moves, known, stop)
                moved += held.old_ids
                # From when its objects moved: a read meanwhile renewed a lease, and the grave falls
                # due at the lease as it stood at the swap (no longer than LEASE_WAIT_S, as sampled).
                held.until = time.monotonic() + LEASE_WAIT_S + HELD_SLACK_S
                if len(held.old_ids) < len(window.moves):
                    windows.pop()  # it will not join: let go at once, and the rest of the run with it
                    table.release_holds(held.offsets)
                    break
                made += 1
            if moved:
                # The old blocks are in the graveyard, due now unless a lease holds them: freed
                # while the windows' pieces are still held, so that each is one block when let go.
                self._free_old_blocks(moved)
        except BaseException:
            for held in windows:
                table.release_holds(held.offsets)
            raise
        with self._lock:
            self._held = windows
        self.settle()
        if made < len(wanted):
            self._quiet_until = time.monotonic() + RETRY_S
        if idle:
            # keep_blocks's own runs: one that could make nothing is tried less and less often.
            self._idle_every = IDLE_CHECK_S if made else min(self._idle_every * 2, IDLE_CHECK_MAX_S)
        if moved or (made < len(wanted) and not idle):
            log.info(
                "compacted the host arena for %d block(s) of up to %d B: %d made, %d object(s) moved "
                "(largest free block %d -> %d B)",
                len(wanted),
                wanted[0],
                made,
                len(moved),
                largest,
                table.room()[1],
            )
        return len(moved)

    def settle(self) -> bool:
        """Let go of the held windows whose old blocks are freed (or whose time is up); whether
        any is still held. The pressure loop calls it at every turn."""
        if not self._held:
            return False
        if any(self._allocated(held.old_ids) for held in self._held):
            self.agent.reclaim_now()  # the graves due by now (at most once per its minimum interval)
        now = time.monotonic()
        still: list[_HeldWindow] = []
        for held in self._held:
            if now < held.until and self._allocated(held.old_ids):
                still.append(held)
            else:
                self.agent.table.release_holds(held.offsets)
        with self._lock:
            self._held = still
        return bool(still)

    def _empty(
        self, blocks: tuple[Block, ...], known: dict[int, EvictionCandidate], stop: threading.Event | None
    ) -> list[int]:
        """Move the allocations of a window out of it, largest first, and return the old ids of
        those moved; stops at the first that does not move. Moved in address order, the smaller
        ones took the free blocks that the window's check had kept for the larger (best fit), and
        the window did not join."""
        done: list[int] = []
        for block in largest_first(blocks):
            assert block.alloc_id is not None
            if (stop is not None and stop.is_set()) or not self.moves.relocate(known[block.alloc_id], block.offset):
                break
            # Its old block stays allocated until the graveyard frees it: not movable meanwhile
            # (a later window of the run would start on it, and its copy find the object gone).
            del known[block.alloc_id]
            done.append(block.alloc_id)
        return done

    def _free_old_blocks(self, alloc_ids: list[int]) -> None:
        """Free the moved objects' old blocks that are due now (those whose lease ran out), in as
        many syncs as the graveyard gives them back in. One sync frees GRAVES_PER_SYNC at most: a
        window of 1024 small objects was let go with some of them still allocated, and was no
        block for the reservation it was made for."""
        for _ in range(len(alloc_ids) // GRAVES_PER_SYNC + 2):
            self.agent.reclaim_now(force=True)
            if not self._allocated(alloc_ids):
                return

    def _allocated(self, alloc_ids: list[int]) -> bool:
        """Whether any of ``alloc_ids`` is still in the arena (its grave not yet freed)."""
        table = self.agent.table
        return any(alloc_id in table for alloc_id in alloc_ids)
