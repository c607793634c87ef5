"""What ``Client.stat()`` returns: the node table and totals, as values and as plain dicts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mooncake_store.types import NodeInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    tier: str
    capacity_bytes: int
    used_bytes: int
    objects: int


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStats:
    node_id: str
    host: str
    zone: str
    pid: int
    alive: bool
    heartbeat_age_s: float  # seconds since the last heartbeat, by the index server's clock
    heartbeat_deadline_in_s: float
    tcp_endpoint: str
    shm_name: str
    transports: tuple[str, ...]
    objects: int
    tiers: tuple[TierStats, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterStats:
    nodes: tuple[NodeStats, ...]
    objects: int
    capacity_bytes: int
    used_bytes: int
    hits: int
    misses: int

    @property
    def live_nodes(self) -> tuple[NodeStats, ...]:
        return tuple(n for n in self.nodes if n.alive)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_stats(
    nodes: dict[str, NodeInfo], per_node: dict[str, int], objects: int, counters: dict[str, int], *, now_ms: int
) -> ClusterStats:
    rows = []
    for node in sorted(nodes.values(), key=lambda n: n.node_id):
        in_s = (node.heartbeat_deadline_ms - now_ms) / 1000
        rows.append(
            NodeStats(
                node_id=node.node_id,
                host=node.host,
                zone=node.zone,
                pid=node.pid,
                alive=in_s >= 0,
                heartbeat_age_s=round(max(0, now_ms - node.last_heartbeat_ms) / 1000, 3),
                heartbeat_deadline_in_s=round(in_s, 3),
                tcp_endpoint=node.tcp_endpoint,
                shm_name=node.shm_name,
                transports=tuple(str(t) for t in node.transports),
                objects=per_node.get(node.node_id, 0),
                tiers=tuple(
                    TierStats(
                        tier=str(t.tier), capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes, objects=t.objects
                    )
                    for t in node.tiers
                ),
            )
        )
    live = [r for r in rows if r.alive]
    return ClusterStats(
        nodes=tuple(rows),
        objects=objects,
        capacity_bytes=sum(t.capacity_bytes for r in live for t in r.tiers),
        used_bytes=sum(t.used_bytes for r in live for t in r.tiers),
        hits=counters.get("hits", 0),
        misses=counters.get("misses", 0),
    )
