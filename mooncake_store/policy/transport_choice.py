"""Which path reaches a replica: the cheapest one both ends support (DESIGN.md §4).

A same-host path is :attr:`TransportKind.SHM`: for a host-tier replica, a memcpy out of the
agent's shared arena; for a GPU-tier replica, a device copy through the GPU arena's CUDA IPC handle
(allowed with shm, since it is the GPU tier's same-host path). Anything else is served by the
agent over TCP, which copies other tiers out first (device to host, or decoding a chunk file).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mooncake_store.types import TRANSPORT_ORDER, NodeInfo, Replica, TierKind, TransportKind

#: Within one path, which tier is read first. Into host memory a GPU replica costs a device-to-host
#: copy more than a host one; into device memory, over the same-host path, a GPU replica is a
#: device-to-device copy, cheaper than a host-to-device one (through an agent both arrive in host
#: memory, so the host order holds). A disk replica is decoded by its agent either way.
TIER_RANK_TO_HOST = {TierKind.HOST: 0, TierKind.GPU: 1, TierKind.DISK: 2}
TIER_RANK_TO_DEVICE = {TierKind.GPU: 0, TierKind.HOST: 1, TierKind.DISK: 2}


def gpu_ipc_node(node: NodeInfo, host_id: str) -> bool:
    """A same-host node whose GPU arena publishes a CUDA IPC handle."""
    return node.host_id == host_id and "gpu_ipc" in node.labels and node.tier(TierKind.GPU) is not None


def choose_transport(
    node: NodeInfo,
    *,
    allowed: Iterable[TransportKind],
    host_id: str,
    shm_reachable: bool,
    tier: TierKind = TierKind.HOST,
    cuda_ipc: bool = False,
) -> TransportKind | None:
    """The cheapest path to a replica in ``tier`` of ``node``. ``shm_reachable``: this process can
    map the node's host arena; ``cuda_ipc``: this process can use CUDA (so can open the node's GPU
    arena through its IPC handle). Disk replicas are always served by their agent."""
    allowed_set = set(allowed)
    for kind in TRANSPORT_ORDER:
        if kind not in allowed_set or kind not in node.transports:
            continue
        if kind == TransportKind.SHM:
            same_host = node.host_id == host_id
            host_path = tier == TierKind.HOST and same_host and shm_reachable
            gpu_path = tier == TierKind.GPU and cuda_ipc and gpu_ipc_node(node, host_id)
            if not (host_path or gpu_path):
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
    cuda_ipc: bool = False,
    to_device: bool = False,
) -> list[tuple[Replica, NodeInfo, TransportKind]]:
    """Replicas with the path to each, cheapest first: the cheaper path first (a same-host copy
    beats any transfer through an agent), then the cheaper tier for the destination (``to_device``:
    the reader wants the bytes in device memory). Replicas no allowed path reaches are left out."""
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
            cuda_ipc=cuda_ipc,
        )
        if kind is not None:
            device_copy = to_device and kind == TransportKind.SHM
            tier_rank = (TIER_RANK_TO_DEVICE if device_copy else TIER_RANK_TO_HOST)[replica.tier]
            out.append((TRANSPORT_ORDER.index(kind) * 10 + tier_rank, replica, node, kind))
    out.sort(key=lambda item: item[0])
    return [(r, n, k) for _, r, n, k in out]
