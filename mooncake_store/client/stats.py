"""What ``Client.stat()`` returns: the node table and totals, as values and as plain dicts.

Their reprs are one line each, with sizes in binary units and only the counters that are not 0
(``print(client.stat())`` printed every field of every tier of every node); every field is still
an attribute, and ``as_dict()`` gives them all."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mooncake_store.config.values import format_size
from mooncake_store.types import NodeInfo, TierUsage


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    tier: str
    capacity_bytes: int
    used_bytes: int  # for the disk tier: what its files take on the filesystem (whole blocks)
    objects: int
    hits: int = 0  # lookups answered with a replica in this tier of this node
    reads: int = 0  # reads the agent served itself (TCP, disk); same-host shm reads never reach it
    demotions: int = 0
    promotions: int = 0
    spills_out: int = 0
    spills_in: int = 0
    evictions: int = 0  # replicas this node's passes dropped from the tier (see ClusterStats.evictions)
    corrupt: int = 0  # replicas found damaged here (a chunk file that failed its checksum), dropped
    copies_out: int = 0  # objects copied to other nodes to restore their replica count (a loss, a dropped copy)
    compacted: int = 0  # objects moved inside the tier's arena to join a block its room was in pieces for
    compression_ratio: float = 1.0  # raw bytes over stored bytes (disk tier)

    def __repr__(self) -> str:
        said = [f"{format_size(self.used_bytes)} of {format_size(self.capacity_bytes)}", _objects(self.objects)]
        said += [f"{name} {getattr(self, name)}" for name in _TIER_COUNTERS if getattr(self, name)]
        if self.compression_ratio != 1.0:
            said.append(f"compression {self.compression_ratio:.2f}x")
        return f"TierStats({self.tier}: {', '.join(said)})"


def _objects(count: int) -> str:
    return f"{count} object" + ("" if count == 1 else "s")


#: The counters a TierStats repr names when they are not 0, in the order `mooncake stat` shows them.
_TIER_COUNTERS = (
    "hits",
    "reads",
    "demotions",
    "promotions",
    "spills_out",
    "spills_in",
    "evictions",
    "corrupt",
    "copies_out",
    "compacted",
)


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
    #: When this incarnation of the agent started (ms since the epoch, by the index server's
    #: clock): the tiers' activity counters count from then, and start again from zero when the
    #: agent restarts.
    started_ms: int = 0
    #: Seconds since then, by the index server's clock (0: unknown).
    uptime_s: float = 0.0

    def __repr__(self) -> str:
        state = "live" if self.alive else f"down {self.heartbeat_age_s:.1f} s"
        where = f"{self.tcp_endpoint}" + (f", zone {self.zone!r}" if self.zone else "")
        return f"NodeStats({self.node_id!r} {state}, {where}, {_objects(self.objects)}, tiers={list(self.tiers)!r})"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterStats:
    nodes: tuple[NodeStats, ...]
    objects: int
    capacity_bytes: int
    used_bytes: int
    hits: int
    misses: int
    #: Objects the cluster dropped under memory pressure (this is a cache): the last readable copy
    #: went. A tier's evictions count the replicas it dropped, so one of two copies evicted is
    #: counted there and not here.
    evictions: int = 0
    corrupt: int = 0  # objects lost because their last readable copy failed its checksum
    #: Objects whose last copies left the index with the nodes that held them: an agent stopped,
    #: or one that died reaped (or back under a new incarnation). Until 2026-12-07 such a loss
    #: showed in no counter: with replicas=2, what one node's death took is what this counts.
    lost: int = 0
    #: Objects short of the replicas they were stored with since a node's loss, their copies not
    #: yet made (re-replication). The next node may go once this is 0 and the last one has left the
    #: node table: a node that died unstopped counts here only once it is reaped.
    short: int = 0

    def __repr__(self) -> str:
        said = [
            f"{len(self.live_nodes)} of {len(self.nodes)} nodes live",
            _objects(self.objects),
            f"{format_size(self.used_bytes)} of {format_size(self.capacity_bytes)} used",
        ]
        counters = ("hits", "misses", "evictions", "corrupt", "lost", "short")
        said += [f"{name} {getattr(self, name)}" for name in counters if getattr(self, name)]
        return f"ClusterStats({', '.join(said)}; nodes={list(self.nodes)!r})"

    @property
    def live_nodes(self) -> tuple[NodeStats, ...]:
        return tuple(n for n in self.nodes if n.alive)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tier_stats(usage: TierUsage, hits: int) -> TierStats:
    c = usage.counters
    raw = c.get("raw_bytes", 0)
    stored = c.get("stored_bytes", usage.used_bytes)  # an agent older than the count: its used bytes
    return TierStats(
        tier=str(usage.tier),
        capacity_bytes=usage.capacity_bytes,
        used_bytes=usage.used_bytes,
        objects=usage.objects,
        hits=hits,
        reads=c.get("reads", 0),
        demotions=c.get("demotions", 0),
        promotions=c.get("promotions", 0),
        spills_out=c.get("spills_out", 0),
        spills_in=c.get("spills_in", 0),
        evictions=c.get("evictions", 0),
        corrupt=c.get("corrupt", 0),
        copies_out=c.get("copies_out", 0),
        compacted=c.get("compacted", 0),
        compression_ratio=round(raw / stored, 3) if raw and stored else 1.0,
    )


def _uptime_s(node: NodeInfo, *, alive: bool, now_ms: int) -> float:
    """How long the node has run: to its last heartbeat once it is dead (a node SIGKILLed 8 s
    earlier showed "up 19s", still counting); 0 where its start is unknown."""
    if not node.started_ms:
        return 0.0
    until_ms = now_ms if alive or not node.last_heartbeat_ms else min(now_ms, node.last_heartbeat_ms)
    return round(max(0, until_ms - node.started_ms) / 1000, 3)


def build_stats(
    nodes: dict[str, NodeInfo], per_node: dict[str, int], objects: int, counters: dict[str, int], *, now_ms: int
) -> ClusterStats:
    # Per node and tier hits come from the index as "hits:<node>:<tier>" counters.
    hits: dict[tuple[str, str], int] = {}
    for name, value in counters.items():
        parts = name.split(":")
        if len(parts) == 3 and parts[0] == "hits":
            hits[(parts[1], parts[2])] = value
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
                tiers=tuple(_tier_stats(t, hits.get((node.node_id, str(t.tier)), 0)) for t in node.tiers),
                started_ms=node.started_ms,
                uptime_s=_uptime_s(node, alive=in_s >= 0, now_ms=now_ms),
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
        evictions=counters.get("evictions", 0),
        corrupt=counters.get("corrupt", 0),
        lost=counters.get("lost", 0),
        short=counters.get("short", 0),
    )
