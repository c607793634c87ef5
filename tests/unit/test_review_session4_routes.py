"""Review of d0f79f0 (transport choice for the GPU tier): pure policy cases that the refactor got wrong
(fixed since; these keep them fixed)."""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_store.policy.transport_choice import order_replicas
from mooncake_store.types import NodeInfo, Replica, TierKind, TierUsage, TransportKind

MiB = 1 << 20


def _node(node_id: str, host: str, *, gpu: bool) -> NodeInfo:
    tiers = [TierUsage(tier=TierKind.HOST, capacity_bytes=100 * MiB, used_bytes=0)]
    if gpu:
        tiers.append(TierUsage(tier=TierKind.GPU, capacity_bytes=MiB, used_bytes=0))
    info = NodeInfo(
        node_id=node_id,
        host=host,
        host_id=host,
        zone="z1",
        pid=1,
        tcp_endpoint="127.0.0.1:1",
        shm_name=f"seg-{node_id}",
        transports=(TransportKind.SHM, TransportKind.TCP),
        tiers=tuple(tiers),
    )
    return dataclasses.replace(info, labels={"gpu_ipc": "00" * 64}) if gpu else info


@pytest.mark.parametrize("gpu_listed_first", [True, False])
def test_device_read_does_not_prefer_an_agent_served_gpu_replica_over_an_agent_served_host_replica(
    gpu_listed_first: bool,
) -> None:
    """Through an agent (TCP) both replicas arrive in host memory and are then copied to the device;
    a GPU replica costs the agent an extra device-to-host copy first. TIER_RANK_TO_DEVICE's reason
    (a GPU replica is a device-to-device copy) holds only on the CUDA IPC path, yet order_replicas
    applies it to every path, so get(device=...) picked the remote GPU replica. The parent commit
    ranked the two equally (replica order); the host replica comes first."""
    nodes = {"far-gpu": _node("far-gpu", "h2", gpu=True), "far-host": _node("far-host", "h3", gpu=False)}
    gpu_rep = Replica(node_id="far-gpu", tier=TierKind.GPU, offset=0, size_bytes=1, alloc_id=1)
    host_rep = Replica(node_id="far-host", tier=TierKind.HOST, offset=0, size_bytes=1, alloc_id=2)
    reps = [gpu_rep, host_rep] if gpu_listed_first else [host_rep, gpu_rep]
    ordered = order_replicas(
        reps,
        nodes,
        allowed=(TransportKind.SHM, TransportKind.TCP),
        host_id="h1",
        shm_names_reachable=set(),
        cuda_ipc=True,
        to_device=True,
    )
    assert [k for _, _, k in ordered] == [TransportKind.TCP, TransportKind.TCP]
    assert [r.tier for r, _, _ in ordered] == [TierKind.HOST, TierKind.GPU]
