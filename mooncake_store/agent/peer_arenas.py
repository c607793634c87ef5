"""Same-host peers' shared arenas, as a spilling agent maps them: a host batch to a peer on this
host goes by memcpy into the peer's arena under its fence (agent/spill.py) once it is mapped here.
Mapping a large arena populates its page tables (~0.1 s per GiB where the peer prefaulted it), so
an agent under pressure maps its same-host peers in the background ahead of the first batch
(premap), and unmaps those that left the node table (retain): a mapping keeps the peer's memory
allocated for as long as it lasts."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from mooncake_store.errors import MooncakeError
from mooncake_store.policy.transport_choice import choose_transport
from mooncake_store.tiers.host import SharedSegment
from mooncake_store.transport.shm import ShmTransport, local_host_id
from mooncake_store.types import NodeInfo, TierKind, TransportKind

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent

log = logging.getLogger("mooncake.agent")


class PeerArenas:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.shm = ShmTransport()
        self._host_id = local_host_id()
        #: Maps same-host peers' arenas while this agent is under pressure, before its first batch
        #: to them: populating a mapping costs ~0.1 s per GiB, a whole burst's worth of copying.
        self._mapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mc-spill-map")
        #: The segment names the node table listed at the last look: a mapping queued before a
        #: peer left is not made after it left.
        self._listed: set[str] = set()

    def close(self) -> None:
        self._mapper.shutdown(wait=True, cancel_futures=True)  # no mapping is made after the unmap
        self.shm.close()

    @property
    def mapped(self) -> bool:
        """Whether any peer's arena is mapped (then the node table is worth a look now and then)."""
        return self.shm.mapped_any()

    def retain(self, peers: list[NodeInfo]) -> None:
        """Given the node table: unmap the shared arenas of peers no longer in it (their memory
        stays allocated while mapped)."""
        self._listed = {p.shm_name for p in peers if p.shm_name}
        self.shm.retain(self._listed)

    def premap(self, peers: list[NodeInfo]) -> None:
        """Under pressure: map, in the background, the arenas of same-host peers not mapped yet, so
        that the first batch to one does not wait for it. Only then: every mapping costs page
        tables (2 MiB per GiB) for as long as it lasts."""
        self.retain(peers)
        for peer in peers:
            if peer.node_id != self.agent.node_id and not self.shm.mapped(peer.shm_name) and self.arena_bytes(peer):
                self._mapper.submit(self._map_if_listed, peer)

    def _map_if_listed(self, peer: NodeInfo) -> None:
        if peer.shm_name in self._listed and not self.shm.mapped(peer.shm_name):
            self.segment(peer, TierKind.HOST)

    def arena_bytes(self, peer_node: NodeInfo) -> int:
        """The size of the peer's host arena when host batches to it go by memcpy, else 0 (TCP)."""
        if not self.agent.config.spill_shm:
            return 0
        path = choose_transport(
            peer_node,
            allowed=(TransportKind.SHM, TransportKind.TCP),
            host_id=self._host_id,
            shm_reachable=self.shm.reachable(peer_node.shm_name),
        )
        usage = peer_node.tier(TierKind.HOST)
        return usage.capacity_bytes if path == TransportKind.SHM and usage is not None else 0

    def segment(self, peer_node: NodeInfo, tier: TierKind) -> SharedSegment | None:
        """The peer's shared arena when a host batch may go there by memcpy, else None (TCP)."""
        size = self.arena_bytes(peer_node) if tier == TierKind.HOST else 0
        if not size:
            return None
        try:
            return self.shm.segment(peer_node.shm_name, size, populate=peer_node.labels.get("prefault") == "1")
        except (MooncakeError, OSError) as exc:  # gone since the table was read, or no room to map: TCP
            log.info("spill to %s: cannot map %s (%s); sending over TCP", peer_node.node_id, peer_node.shm_name, exc)
            return None
