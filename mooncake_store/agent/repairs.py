"""Re-replication: objects that a dead node's purge left with fewer readable replicas than they
were stored with (or a damaged copy's drop, or a full node's eviction of a copy) are copied to
other nodes until they have their count again. A copy a full node dropped goes only into room
under a peer's low watermark, which no pressure pass takes back: into room under the high one, it
would go back to the next node to fill, to be dropped again at its next pass.

The index lists such an object in ``repair:<node>`` of the first live node that still holds a
readable replica (index/lua/prelude.lua: note_short); that node's agent takes its list here, every
REPAIR_EVERY_S from its pressure loop, and copies each object as a spill does (agent/spill.py:
a guarded reservation on the peer, the bytes, then one index call for the batch), except that its
own replica stays and the index adds the peer's copy beside it (copy_replicas.lua). A target is
chosen as a spill's is (policy/eviction.py: choose_move: a live peer with room under its high
watermark, on a host and then in a zone that no copy of the object is on, then same zone first),
never a node that holds a replica already. With ``replicas = 2`` a
node's loss is repaired before the next one: a rolling restart loses nothing.

A copy goes to the tier its replica is in here when a peer has room there, else to a peer's host
tier, else to its disk tier (FALLBACK_TIERS), in the form that tier keeps (agent/payloads.py): a
chunk file with no peer that has a disk tier stayed short for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from mooncake_store.agent.moves import MoveTarget
from mooncake_store.agent.placing import peer_target
from mooncake_store.agent.spill import Spiller, SpillJob
from mooncake_store.agent.spill_jobs import FALLBACK_TIERS
from mooncake_store.index.pressure import RepairCandidate
from mooncake_store.types import EvictionCandidate, NodeInfo, TierKind

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent

log = logging.getLogger("mooncake.agent")

#: How often an agent asks the index for objects it is to copy (one call, cheap when none).
REPAIR_EVERY_S = 1.0
#: Objects taken per call.
REPAIR_BATCH = 256

JobOf = Callable[[EvictionCandidate], SpillJob | None]


class Repairs:
    def __init__(
        self,
        agent: Agent,
        spiller: Spiller,
        job_of: Mapping[TierKind, JobOf],
        count: Callable[..., None],
        note_silent: Callable[[set[str]], None],
        resolve: Callable[[list[MoveTarget]], object],
    ) -> None:
        """``note_silent``: told of the peers that did not answer a copy (no answer, a reset, a
        timeout), which the pressure manager then leaves out for a heartbeat TTL, as after a spill:
        a hung peer that still heartbeats looks the emptiest, and every call would wait it out."""
        self.agent = agent
        self._spiller = spiller
        self._job_of = job_of
        self._count = count
        self._note_silent = note_silent
        #: LocalMoves.resolve: copies whose swap's answer was lost, counted once the index names them.
        self._resolve = resolve
        #: The last call took a full batch and copied some of it: its list likely holds more, and
        #: the next call comes at the pressure loop's next turn rather than REPAIR_EVERY_S later
        #: (256 a second held a node's thousands of small objects one loss from gone for minutes).
        self.more = False

    def run_once(self, refused: set[str]) -> int:
        """Copy what this node is to copy now; returns the copies made. ``refused``: peers to leave
        out (silent ones); a candidate with no peer to go to, or whose peer refused or broke, stays
        listed for the next call."""
        agent = self.agent
        self.more = False
        candidates = agent.index.repair_candidates(agent.node_id, count=REPAIR_BATCH)
        if not candidates:
            return 0
        peers = list(agent.index.nodes().values())
        plan = self._plan(candidates, peers, refused, now_ms=agent.index.server_time_ms())
        copied = 0
        turned_down: set[str] = set()
        by_id = {peer.node_id: peer for peer in peers}
        for (node_id, tier, source), jobs in plan.items():
            if node_id in turned_down:
                continue  # refused or broke on another tier in this call: asked again next time
            result = self._spiller.spill(by_id[node_id], jobs, tier=tier, copy=True, source=source)
            self._note_silent(self._spiller.take_unreachable())
            if result.refused:
                turned_down.add(node_id)
            if result.moved:
                copied += len(result.moved)
                self._count(source, "copies_out", len(result.moved))
            if result.unknown:
                self._resolve([target for _, target in result.unknown])
            if result.error is not None:
                raise result.error  # the index failed: the rest waits for the next call
        if copied:
            log.info("copied %d object(s) short of their replicas to other nodes", copied)
        self.more = copied > 0 and len(candidates) >= REPAIR_BATCH
        return copied

    def _under_low(self, peer: NodeInfo) -> float:
        """A peer's low watermark, as it publishes it, else this agent's."""
        return peer.low_watermark(self.agent.config.low_watermark)

    def _plan(
        self, candidates: list[RepairCandidate], peers: list[NodeInfo], refused: set[str], *, now_ms: int
    ) -> dict[tuple[str, TierKind, TierKind], list[SpillJob]]:
        """Each candidate's missing copies, one per target node, batched per (node, its tier, the
        tier here)."""
        by_id = {peer.node_id: peer for peer in peers}
        # Planned per tier: a node's host and disk tiers fill apart.
        planned: dict[TierKind, dict[str, int]] = {}
        plan: dict[tuple[str, TierKind, TierKind], list[SpillJob]] = {}
        for cand in candidates:
            job_of = self._job_of.get(cand.tier)
            victim = EvictionCandidate(
                key=cand.key,
                size_bytes=cand.size_bytes,
                last_access_ms=0,
                lease_until_ms=0,
                pins=0,
                alloc_id=cand.alloc_id,
                chain_pos=-1,
                dtype=cand.dtype,  # a chunk file made for a copy shuffles 2-byte dtypes
                other_nodes=cand.holders,
            )
            job = job_of(victim) if job_of is not None else None
            if job is None:
                continue  # freed here since the index listed it (moved or removed meanwhile)
            taken = set(cand.holders) | refused
            spread = [by_id[n] for n in cand.holders if n in by_id]  # where its copies are, planned ones too
            targets = (cand.tier, *(t for t in FALLBACK_TIERS if t != cand.tier))
            # A copy a full node dropped goes back only into room no pressure pass takes back.
            fill_mark = self._under_low if cand.thinned else None
            for _ in range(cand.missing):
                # A peer with the bytes in pieces too small compacts when refused: else no copy
                # would ever go to the one peer left with room, in pieces (agent/compaction.py).
                placed = peer_target(
                    self.agent,
                    job,
                    cand.tier,
                    targets,
                    peers,
                    now_ms,
                    planned,
                    taken,
                    spread,
                    fill_mark=fill_mark,
                    in_pieces_last=True,
                )
                if placed is None:
                    break  # no node has room for it now: it stays listed
                node_id, tier, sent = placed
                plan.setdefault((node_id, tier, cand.tier), []).append(sent)
                on_tier = planned[tier]
                on_tier[node_id] = on_tier.get(node_id, 0) + sent.room_on(by_id[node_id].tier(tier))
                taken.add(node_id)
                spread.append(by_id[node_id])
        return plan
