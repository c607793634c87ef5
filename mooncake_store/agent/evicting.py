"""The evictions of a pressure pass (agent/pressure.py): the victims with nowhere to go, queued in
the walk's cold-first order and sent to the index in one round trip (evict.lua), or through
evict_chains.lua when a chain chunk that stored chunks hang off is among them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mooncake_store.agent.moves import CHAIN_VICTIMS, LocalMoves
from mooncake_store.agent.placing import PassState
from mooncake_store.agent.spill import SpillJob
from mooncake_store.types import EvictionCandidate, TierKind

if TYPE_CHECKING:
    from mooncake_store.agent.drains import Drains
    from mooncake_store.agent.node import Agent

#: What those of the alloc ids that live in the tier here take there (stored bytes on disk).
BytesIn = Callable[[TierKind, list[int]], int]


class Evictions:
    def __init__(self, agent: Agent, moves: LocalMoves, drains: Drains, bytes_in: BytesIn) -> None:
        self.agent = agent
        self.moves = moves
        self.drains = drains
        self.bytes_in = bytes_in

    @staticmethod
    def queue(job: SpillJob, state: PassState) -> None:
        """Queue a victim for eviction (evict_queued), in the walk's cold-first order."""
        victim = job.victim
        last_replica = not victim.other_nodes
        if last_replica and victim.children - state.children_gone[victim.key] > 0:
            # The last copy of a chain chunk that stored chunks hang off: it stands for its chain,
            # which is cut back from its leaves (evict_queued).
            state.chains_queued = True
        elif last_replica and victim.chain_parent:
            # One child fewer for the parent, if the eviction goes through; if it does not, the
            # parent's own eviction later in the batch finds the child and is refused (PARENT).
            state.children_gone[victim.chain_parent] += 1
        state.evictions.append(job)

    def evict_until(self, jobs: list[SpillJob], state: PassState, tier: TierKind, *, moved: int, need: int) -> int:
        """Evict ``jobs`` (victims with nowhere to go, in the order they are to go) until the pass
        has moved ``need`` bytes, ``moved`` of them before: as many as the room still wanted, in
        one round trip, then on past those refused (read, pinned or grown a child since the
        sample). Returns the bytes the pass has moved now."""
        left = list(jobs)
        while left and moved < need:
            while left and moved < need:
                job = left.pop(0)
                self.queue(job, state)
                moved += job.room_bytes
            moved -= self.evict_queued(state, tier, need_left=need - moved)
        return moved

    def evict_queued(self, state: PassState, tier: TierKind, *, need_left: int) -> int:
        """Evict the pass's queued victims, in order, in one index round trip (evict.lua); returns
        the bytes counted for them that did not go (pinned, read, replaced or still a parent since
        the sample was taken; ``need_left``: what the pass still needed beyond them, <= 0 when
        they were to make up all of it). A chunk that stayed is its parent's child again: the parent
        is no leaf for the rest of the pass.

        With a chain chunk among them (the last copy of a chunk stored chunks hang off), they go
        through evict_chains.lua instead, still in order: each chain chunk stands for its chain,
        whose later chunks no reader touched since it (a load reads a prompt's chunks from the
        first; a store counts as an access of the chunks it extends), and the chain is cut back
        from its leaves, wherever they are, as far as needed. Counted at its own size, a chain
        chunk makes the walk queue warmer victims than needed: the script stops once the room
        wanted was made, so those go only when the colder chains did not make it. Skipped instead,
        such chunks let a pass with more objects than its sample evict the warmer leaves it held,
        a hot prompt's among them, while cold chains stayed whole."""
        queued, state.evictions = state.evictions, []
        if not queued:
            return 0
        counted = sum(job.room_bytes for job in queued)
        touched: set[int] = set()  # refused for an access since the pass began, and for that alone
        try:
            if state.chains_queued:
                state.chains_queued = False
                state.children_gone.clear()  # the script judged every one by the index itself
                return counted - self.evict_chains(
                    [job.victim for job in queued],
                    tier,
                    max(0, need_left) + counted,
                    since_ms=state.sampled_ms,
                    touched=touched,
                )
            gone = self.moves.evict_many(
                [job.victim for job in queued], tier, since_ms=state.sampled_ms, touched=touched
            )
        finally:
            state.touched.extend(job for job in queued if job.victim.alloc_id in touched)
        refused = [job for job, ok in zip(queued, gone, strict=True) if not ok]
        for job in refused:
            if not job.victim.other_nodes and job.victim.chain_parent:
                state.children_gone[job.victim.chain_parent] -= 1
        return sum(job.room_bytes for job in refused)

    def evict_chains(
        self,
        victims: list[EvictionCandidate],
        tier: TierKind,
        need: int,
        *,
        since_ms: int | None = None,
        touched: set[int] | None = None,
    ) -> int:
        """Evict ``victims`` in order, each chain chunk among them with its chain cut back from its
        leaves first, wherever they are (evict_chains.lua), until ``need`` bytes of room were made
        in ``tier`` here; returns the room made: what the allocations that went take here (on a
        disk, their files' blocks). Not one with a later chunk pinned or read, nor one whose later
        chunks are on another tier of this node that is under pressure: that tier's own pass moves
        those (demotes them, or evicts them leaves first), and this chunk can then be demoted.
        CHAIN_VICTIMS per round trip, the next ones only while room is still wanted."""
        disk = self.agent.disk
        # The script stops by the chunks' plain sizes (the index's); a disk's room is in the blocks
        # its files take: asked in blocks, it stopped at the first compressible chain. So it is
        # asked by the disk's ratio, and the room made is counted from the files that went (a
        # compressible chain among incompressible victims made the average ratio count 12 KiB of
        # blocks as 140).
        scale = disk.raw_bytes / disk.used_bytes if tier == TierKind.DISK and disk and disk.used_bytes else 1.0
        pressed = self._pressed(but=tier)
        made = 0
        for start in range(0, len(victims), CHAIN_VICTIMS):
            if made >= need:
                break
            wanted = int((need - made) * scale)
            made += self.bytes_in(
                tier,
                self.moves.evict_chains(
                    victims[start : start + CHAIN_VICTIMS], tier, wanted, pressed, since_ms=since_ms, touched=touched
                ),
            )
        return made

    def _pressed(self, *, but: TierKind) -> list[TierKind]:
        """This node's other tiers past their high watermark or draining: their own passes run
        this wake (or ran, and run again at the next) and move their chunks, leaves first. A drain
        backing off between the watermarks (its passes found nothing movable) runs no pass now."""
        high = self.agent.config.high_watermark
        draining = self.drains.running()
        return [
            t.tier
            for t in self.agent.tiers()
            if t.tier != but and (t.used_bytes > high * t.capacity_bytes or t.tier in draining)
        ]
