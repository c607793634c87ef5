"""Memory pressure: the agent's loop that keeps each tier under its high watermark.

Each pass asks the pure policy (policy/eviction.py) what to move and where, then carries the moves
out, each one as DESIGN.md §3.4 wants: copy the bytes, compare-and-swap the location in the index,
and only then let the old copy go (through the graveyard, so a reader that still holds a lease on
the object keeps reading whole bytes).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake_store.agent.server import SPILL_FLAG
from mooncake_store.errors import MooncakeError
from mooncake_store.policy.eviction import MoveKind, bytes_to_free, choose_move, choose_victims, next_tier
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import EvictionCandidate, NodeInfo, Replica, ReplicaState, TierKind

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent

log = logging.getLogger("mooncake.agent")

#: Objects sampled from the index per pass.
SAMPLE = 256
#: Passes in a row while each one still moves something.
MAX_PASSES = 32


@dataclass(slots=True)
class _PassState:
    peers: list[NodeInfo]
    planned: dict[str, int] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)


class PressureManager:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.counters: dict[TierKind, Counter[str]] = {t: Counter() for t in TierKind}
        self._wanted_bytes = 0
        self._wanted_gpu_bytes = 0
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._peers = TcpTransport(timeout_s=30.0, connections_per_peer=1, stripe_bytes=1 << 62)

    def close(self) -> None:
        self._peers.close()

    # ---- signals from the server ------------------------------------------------------------
    def want_room(self, size_bytes: int, *, tier: TierKind = TierKind.HOST) -> None:
        """A reservation of ``size_bytes`` did not fit: make room now rather than at the next pass."""
        with self._lock:
            if tier == TierKind.GPU:
                self._wanted_gpu_bytes = max(self._wanted_gpu_bytes, size_bytes)
            else:
                self._wanted_bytes = max(self._wanted_bytes, size_bytes)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def count(self, tier: TierKind, name: str, n: int = 1) -> None:
        self.counters[tier][name] += n

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        interval = self.agent.config.pressure_interval_s
        while not stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            if stop.is_set():
                return
            try:
                # Evicting a chain's last chunk makes its parent a leaf only then, so one sample can
                # free little; sample again while passes make progress.
                self.relieve_gpu()
                for _ in range(MAX_PASSES):
                    if self.relieve_host() == 0:
                        break
                self.relieve_disk()
            except MooncakeError as exc:
                log.warning("pressure pass failed: %s", exc)

    def relieve_host(self) -> int:
        """One pass over the host tier; returns the bytes moved away."""
        agent = self.agent
        cfg = agent.config
        used, _, largest_free, _ = agent.table.usage()
        with self._lock:
            wanted, self._wanted_bytes = self._wanted_bytes, 0
        if wanted and largest_free >= wanted:
            wanted = 0  # freed meanwhile
        need = bytes_to_free(
            used, agent.table.capacity_bytes, high=cfg.high_watermark, low=cfg.low_watermark, wanted_bytes=wanted
        )
        if wanted > largest_free:  # free space may be in pieces too small for the waiting reservation
            need = max(need, wanted - largest_free)
        if need <= 0:
            return 0
        # Space of removed and replaced objects comes back by itself once their read leases end:
        # free what is due now, and do not move live objects out for what is merely waiting.
        agent.reclaim_now()
        used, _, largest_free, _ = agent.table.usage()
        returning = agent.table.bytes_of(agent.index.pending_graves(agent.node_id))
        need = bytes_to_free(
            used - returning,
            agent.table.capacity_bytes,
            high=cfg.high_watermark,
            low=cfg.low_watermark,
            wanted_bytes=wanted,
        )
        if wanted > largest_free + returning:  # the free space may be in pieces too small for it
            need = max(need, wanted - largest_free - returning)
        if need <= 0:
            return 0
        now_ms = agent.index.server_time_ms()
        candidates = agent.index.victim_candidates(agent.node_id, str(TierKind.HOST), sample=SAMPLE)
        # One read of the node table per pass; what this pass sends each peer is counted here.
        pass_state = _PassState(peers=list(agent.index.nodes().values()) if cfg.spill_to_peers else [])
        moved = 0
        # Walk the whole cold-first order: a victim that may not leave (a chain chunk that others
        # hang off, when eviction is the only way out) is skipped, not the end of the pass.
        for victim in choose_victims(candidates, need_bytes=sum(c.size_bytes for c in candidates), now_ms=now_ms):
            if moved >= need:
                break
            if self._move_host_victim(victim, now_ms, pass_state):
                moved += victim.size_bytes
        if moved:
            # The old copies sit in the graveyard, due now (a victim's lease had run out): free
            # them at once rather than at the next sync tick, so a waiting writer gets its room.
            agent.reclaim_now()
        return moved

    def _move_host_victim(self, victim: EvictionCandidate, now_ms: int, state: _PassState) -> bool:
        agent = self.agent
        location = agent.table.offset_of(victim.alloc_id)
        if location is None:
            return False  # freed since the sample was taken
        offset, _ = location
        lower = next_tier(TierKind.HOST, agent.tier_kinds())
        lower_free = agent.disk.free_bytes if (lower == TierKind.DISK and agent.disk is not None) else 0
        for _ in range(3):  # a peer that refuses is left out and the next one asked
            move = choose_move(
                victim.size_bytes,
                tier=TierKind.HOST,
                node_id=agent.node_id,
                zone=agent.config.zone,
                lower_tier=lower,
                lower_free_bytes=lower_free,
                peers=state.peers,
                now_ms=now_ms,
                high_watermark=agent.config.high_watermark,
                spill=agent.config.spill_to_peers,
                planned_bytes=state.planned,
                refused=state.refused,
            )
            if move.kind == MoveKind.DEMOTE:
                return self._demote(victim, offset)
            if move.kind != MoveKind.SPILL or move.node_id is None:
                break
            peer = next(p for p in state.peers if p.node_id == move.node_id)
            if self._spill(victim, offset, peer):
                state.planned[peer.node_id] = state.planned.get(peer.node_id, 0) + victim.size_bytes
                return True
            state.refused.add(peer.node_id)
        if victim.children > 0:
            return False  # evicting it would cut its chain's later chunks off from every match
        return self._evict(victim, TierKind.HOST)

    def _demote(self, victim: EvictionCandidate, offset: int) -> bool:
        agent = self.agent
        assert agent.disk is not None
        disk_id = agent.table.new_id()
        view = agent.arena.view(offset, victim.size_bytes)
        try:
            agent.disk.write(disk_id, view, itemsize=agent.itemsize_of(victim.dtype))
        except MooncakeError as exc:
            log.info("demotion of %s failed: %s", victim.key, exc)
            return False
        finally:
            view.release()
        if not self._swap(
            victim.key,
            old_alloc_id=victim.alloc_id,
            node_id=agent.node_id,
            tier=TierKind.DISK,
            offset=0,
            size_bytes=victim.size_bytes,
            alloc_id=disk_id,
        ):
            agent.disk.remove(disk_id)
            return False
        agent.disk_keys[disk_id] = victim.key
        self.count(TierKind.HOST, "demotions")
        return True

    def _spill(self, victim: EvictionCandidate, offset: int, peer_node: NodeInfo) -> bool:
        agent = self.agent
        peer_id = peer_node.node_id
        peer = self._peers.peer(peer_node.tcp_endpoint)
        try:
            (res,) = peer.reserve([(victim.size_bytes, uuid.uuid4().bytes)], node_id=peer_id, flags=SPILL_FLAG)
        except MooncakeError as exc:
            log.info("spill of %s to %s refused: %s", victim.key, peer_id, exc)
            return False
        view = agent.arena.view(offset, victim.size_bytes)
        try:
            if victim.size_bytes:
                peer.write(res.alloc_id, res.offset, view)
        except MooncakeError as exc:
            log.info("spill of %s to %s failed mid-transfer: %s", victim.key, peer_id, exc)
            self._peers.drop_peer(peer_node.tcp_endpoint)
            self._expire_remote(peer_node.tcp_endpoint, res.alloc_id)
            return False
        finally:
            view.release()
        if not self._swap(
            victim.key,
            old_alloc_id=victim.alloc_id,
            node_id=peer_id,
            tier=TierKind.HOST,
            offset=res.offset,
            size_bytes=victim.size_bytes,
            alloc_id=res.alloc_id,
        ):
            self._expire_remote(peer_node.tcp_endpoint, res.alloc_id)
            return False
        self.count(TierKind.HOST, "spills_out")
        return True

    def _swap(
        self, key: str, *, old_alloc_id: int, node_id: str, tier: TierKind, offset: int, size_bytes: int, alloc_id: int
    ) -> bool:
        """Compare-and-swap one of this agent's replicas of ``key`` to the new location (which its
        agent learns of through its ack list); False when the object moved, went or is pinned."""
        new = Replica(
            node_id=node_id,
            tier=tier,
            offset=offset,
            size_bytes=size_bytes,
            alloc_id=alloc_id,
            state=ReplicaState.COMPLETE,
        )
        status = self.agent.index.move_replica(key, old_node=self.agent.node_id, old_alloc_id=old_alloc_id, new=new)
        return status == "OK"

    def _expire_remote(self, endpoint: str, alloc_id: int) -> None:
        try:
            self._peers.peer(endpoint).free([alloc_id])
        except MooncakeError:
            pass  # the peer reclaims the reservation after its timeout anyway

    def _evict(self, victim: EvictionCandidate, tier: TierKind) -> bool:
        status = self.agent.index.evict(victim.key, node_id=self.agent.node_id, alloc_id=victim.alloc_id)
        if status == "OK":
            self.count(tier, "evictions")
            return True
        return False

    def relieve_gpu(self) -> int:
        """GPU tier: demote the coldest objects to host memory (one device-to-host copy each), or
        evict them when the host tier has no room below its high watermark."""
        agent = self.agent
        table, gpu = agent.gpu_table, agent.gpu
        if table is None or gpu is None:
            return 0
        cfg = agent.config
        used, _, _, _ = table.usage()
        with self._lock:
            wanted, self._wanted_gpu_bytes = self._wanted_gpu_bytes, 0
        need = bytes_to_free(
            used, table.capacity_bytes, high=cfg.high_watermark, low=cfg.low_watermark, wanted_bytes=wanted
        )
        if need <= 0:
            return 0
        now_ms = agent.index.server_time_ms()
        candidates = agent.index.victim_candidates(agent.node_id, str(TierKind.GPU), sample=SAMPLE)
        moved = 0
        for victim in choose_victims(candidates, need_bytes=sum(c.size_bytes for c in candidates), now_ms=now_ms):
            if moved >= need:
                break
            location = table.offset_of(victim.alloc_id)
            if location is None:
                continue
            host_used, _, _, _ = agent.table.usage()
            fits = host_used + victim.size_bytes <= cfg.high_watermark * agent.table.capacity_bytes
            allocs = agent.table.reserve([(victim.size_bytes, b"demote-gpu" + bytes(6))]) if fits else None
            if allocs is None:
                if victim.children == 0 and self._evict(victim, TierKind.GPU):
                    moved += victim.size_bytes
                continue
            alloc = allocs[0]
            view = agent.arena.view(alloc.offset, victim.size_bytes)
            try:
                gpu.read_to_host(location[0], view)
            finally:
                view.release()
            if not self._swap(
                victim.key,
                old_alloc_id=victim.alloc_id,
                node_id=agent.node_id,
                tier=TierKind.HOST,
                offset=alloc.offset,
                size_bytes=victim.size_bytes,
                alloc_id=alloc.alloc_id,
            ):
                agent.table.free([alloc.alloc_id])
                continue
            self.count(TierKind.GPU, "demotions")
            moved += victim.size_bytes
        return moved

    def relieve_disk(self) -> int:
        agent = self.agent
        disk = agent.disk
        if disk is None:
            return 0
        cfg = agent.config
        need = bytes_to_free(disk.used_bytes, disk.capacity_bytes, high=cfg.high_watermark, low=cfg.low_watermark)
        if need <= 0:
            return 0
        now_ms = agent.index.server_time_ms()
        candidates = agent.index.victim_candidates(agent.node_id, str(TierKind.DISK), sample=SAMPLE)
        # Sizes in the index are raw bytes; the disk holds compressed ones. Evict by stored size.
        stored = {c.alloc_id: (disk.entry(c.alloc_id) or None) for c in candidates}
        moved = 0
        for victim in choose_victims(candidates, need_bytes=sum(c.size_bytes for c in candidates), now_ms=now_ms):
            if moved >= need:
                break
            if victim.children > 0:
                continue
            entry = stored.get(victim.alloc_id)
            if entry is not None and self._evict(victim, TierKind.DISK):
                moved += entry.stored_bytes
        return moved

    # ---- promotion --------------------------------------------------------------------------
    def promote(self, disk_id: int, data: bytearray) -> bool:
        """Bring an object read from disk back to host memory, if that leaves the host tier under
        its high watermark (so promotion and demotion do not chase each other)."""
        agent = self.agent
        key = agent.disk_keys.get(disk_id)
        if key is None:
            return False
        used, _, _, _ = agent.table.usage()
        if used + len(data) > agent.config.high_watermark * agent.table.capacity_bytes:
            return False
        allocs = agent.table.reserve([(len(data), b"promote-" + disk_id.to_bytes(8, "little"))])
        if allocs is None:
            return False
        alloc = allocs[0]
        view = agent.arena.view(alloc.offset, len(data))
        try:
            view[:] = data
        finally:
            view.release()
        if not self._swap(
            key,
            old_alloc_id=disk_id,
            node_id=agent.node_id,
            tier=TierKind.HOST,
            offset=alloc.offset,
            size_bytes=len(data),
            alloc_id=alloc.alloc_id,
        ):
            agent.table.free([alloc.alloc_id])
            return False
        self.count(TierKind.DISK, "promotions")
        return True
