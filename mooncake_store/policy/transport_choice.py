"""Which path reaches a replica: the cheapest one both ends support (DESIGN.md §4)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mooncake_store.types import TRANSPORT_ORDER, NodeInfo, Replica, TierKind, TransportKind

# A GPU replica costs a device-to-host copy (through the arena's CUDA IPC handle where the client is
# on the same host and can use CUDA, else by its agent and then TCP), so host memory is cheaper.
TIER_RANK = {TierKind.HOST: 0, TierKind.GPU: 1, TierKind.DISK: 2}


def choose_transport(
    node: NodeInfo,
    *,
    allowed: Iterable[TransportKind],
    host_id: str,
    shm_reachable: bool,
    tier: TierKind = TierKind.HOST,
) -> TransportKind | None:
    """Only the host tier is mapped by same-host clients; other tiers are served by their agent."""
    allowed_set = set(allowed)
    for kind in TRANSPORT_ORDER:
        if kind not in allowed_set or kind not in node.transports:
            continue
        if kind == TransportKind.SHM and not (node.host_id == host_id and shm_reachable and tier == TierKind.HOST):
            continue
        if kind == TransportKind.INPROC:
            continue  # agents run in their own processes
        return kind
    return None


def order_replicas(
    replicas: Sequence[Replica],
    nodes: dict[str, NodeInfo],
    *,
    allowed: Iterable[TransportKind],
    host_id: str,
    shm_names_reachable: set[str],
) -> list[tuple[Replica, NodeInfo, TransportKind]]:
    """Replicas with the path to each, cheapest first (faster tier first, then cheaper path);
    replicas no allowed path reaches are left out."""
    allowed_t = tuple(allowed)
    out: list[tuple[int, Replica, NodeInfo, TransportKind]] = []
    for replica in replicas:
        node = nodes.get(replica.node_id)
        if node is None:
            continue
        kind = choose_transport(
            node,
            allowed=allowed_t,
            host_id=host_id,
            shm_reachable=node.shm_name in shm_names_reachable,
            tier=replica.tier,
        )
        if kind is not None:
            out.append((TIER_RANK[replica.tier] * 10 + TRANSPORT_ORDER.index(kind), replica, node, kind))
    out.sort(key=lambda item: item[0])
    return [(r, n, k) for _, r, n, k in out]
