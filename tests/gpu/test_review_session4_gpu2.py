"""Review of the GPU tier (tiers/gpu.py, client/device.py, the GPU parts of puts and the agent's
pressure handling): device puts that the GPU tier cannot take, a fragmented GPU tier that never
makes room, and CUDA IPC mappings of agents that left. Like test_gpu_tier.py, these run only where
cupy sees a CUDA device (tests/gpu/conftest.py skips them elsewhere)."""

from __future__ import annotations

import gc
import uuid

import numpy as np
import pytest
from helpers import random_bytes, wait_until

from mooncake_store import Client
from mooncake_store.config import AgentConfig
from mooncake_store.errors import MooncakeError, NoCapacity
from mooncake_store.tiers import gpu as gpu_module
from mooncake_store.transport.tcp import TcpTransport

MiB = 1 << 20


def _tier(client: Client, key: str) -> tuple[str, str]:
    meta = client.object_meta(key)
    assert meta is not None
    return meta.replicas[0].node_id, str(meta.replicas[0].tier)


def test_device_put_larger_than_the_gpu_tier_is_staged_to_host(cupy, make_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    """puts.py plan() sends every device array to the GPU tier as soon as some same-host node has
    one, whatever its size: _candidates then keeps only GPU nodes and rank_nodes raises a permanent
    NoCapacity for an array larger than every GPU tier, although the host tier has room (and the
    same array on a host without a GPU tier is staged to host memory and stored)."""
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(64 * MiB), "--gpu-mem", str(8 * MiB)])
    client: Client = make_client(cluster, timeout_s=5)
    value = random_bytes(12 * MiB, 1)
    client.put("big", cupy.asarray(value))
    assert _tier(client, "big") == ("gpu-0", "host")
    assert np.array_equal(client.get("big"), value)


def test_device_put_to_a_preferred_node_without_gpu_tier(cupy, make_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    """With a GPU node on the host, a device put with preferred_node naming a node that has no GPU
    tier fails with NoCapacity ("preferred node ... is not a live agent", which it is): the GPU
    plan filters that node out instead of staging the array to its host tier."""
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(16 * MiB), "--gpu-mem", str(8 * MiB)])
    cluster.add_agent(node_id="cpu-0", extra_args=["--host-bytes", str(16 * MiB)])
    client: Client = make_client(cluster, timeout_s=5)
    value = random_bytes(MiB, 2)
    client.put("pinned-here", cupy.asarray(value), preferred_node="cpu-0")
    assert _tier(client, "pinned-here") == ("cpu-0", "host")
    assert np.array_equal(client.get("pinned-here"), value)


def test_fragmented_gpu_tier_makes_room_for_a_waiting_put(cupy, make_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    """relieve_gpu passed a refused reservation's size to the need (Drains.need) as is:
    bytes_to_free then asks for nothing while the tier's free bytes add up to the size, even
    though no free block is large enough. relieve_host handles exactly this (largest free
    block); on the GPU tier the writer waits out its timeout and gets NoCapacity although
    demoting one object to host would do."""
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(64 * MiB), "--gpu-mem", str(16 * MiB)])
    client: Client = make_client(cluster, timeout_s=6, lease_ms=200)
    for i in range(4):  # 12 of 16 MiB: under the high watermark, laid out back to back
        client.put(f"frag/{i}", cupy.asarray(random_bytes(3 * MiB, 10 + i)))
    offsets = sorted(client.object_meta(f"frag/{i}").replicas[0].offset for i in range(4))  # type: ignore[union-attr]
    assert offsets == [0, 3 * MiB, 6 * MiB, 9 * MiB], offsets
    client.remove("frag/0")
    client.remove("frag/2")

    def gpu_used() -> int:
        return next(t.used_bytes for n in client.stat().nodes for t in n.tiers if t.tier == "gpu")

    # Free now: [0, 3), [6, 9) and [12, 16) MiB, 10 MiB in all, the largest block 4 MiB.
    assert wait_until(lambda: gpu_used() == 6 * MiB, timeout_s=10), gpu_used()
    value = random_bytes(5 * MiB, 20)
    client.put("frag/big", cupy.asarray(value))  # NoCapacity after timeout_s on the current code
    assert np.array_equal(cupy.asnumpy(client.get("frag/big", device=0)), value)


def test_gpu_segments_of_agents_that_left_are_closed(cupy, make_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    """GpuSegments closes an agent's IPC mapping only when the same node id publishes another
    handle. An agent that leaves for good (or restarts under the default node id, which carries
    its pid) stays mapped in every client until the client closes: each mapping pins the dead
    agent's whole GPU arena in device memory."""
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-a", extra_args=["--host-bytes", str(16 * MiB), "--gpu-mem", str(8 * MiB)])
    reader: Client = make_client(cluster)
    writer: Client = make_client(cluster)
    writer.put("a", cupy.asarray(random_bytes(MiB, 3)))
    reader.get("a", device=0)
    assert reader._gpu is not None and reader._gpu.open_count() == 1
    cluster.agent("gpu-a").stop()  # leaves the cluster: deregistered, its arena freed
    cluster.add_agent(node_id="gpu-b", extra_args=["--host-bytes", str(16 * MiB), "--gpu-mem", str(8 * MiB)])
    fresh: Client = make_client(cluster)
    value = random_bytes(MiB, 4)
    fresh.put("b", cupy.asarray(value))
    assert np.array_equal(cupy.asnumpy(reader.get("b", device=0)), value)  # re-reads the node table
    assert "gpu-a" not in reader._node_table()
    assert reader._gpu.open_count() == 1, "the mapping of gpu-a, which left, is still open"


def test_a_refused_gpu_reservation_names_the_room(cupy, make_cluster) -> None:  # type: ignore[no-untyped-def]
    """A host-tier refusal carries free bytes, largest block and capacity; the server answers a
    GPU-tier refusal with a bare NO_CAPACITY (server._reserve, the tier != TIER_HOST branch), so the
    writer's NoCapacity names no number about the GPU tier (DESIGN.md §6: messages carry numbers)."""
    cluster = make_cluster(0)
    agent = cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(16 * MiB), "--gpu-mem", str(8 * MiB)])
    transport = TcpTransport(timeout_s=5.0, connections_per_peer=1, stripe_bytes=1 << 62)
    try:
        peer = transport.peer(agent.endpoint)
        (held,) = peer.reserve([(6 * MiB, uuid.uuid4().bytes)], node_id="gpu-0", tier=1)
        try:
            with pytest.raises(NoCapacity) as refused:
                peer.reserve([(4 * MiB, uuid.uuid4().bytes)], node_id="gpu-0", tier=1)
            message = str(refused.value)
            assert str(8 * MiB) in message and str(2 * MiB) in message, message
        finally:
            peer.free([held.alloc_id])
    finally:
        transport.close()


def test_a_half_built_agent_releases_its_gpu_arena(cupy, redis_url) -> None:  # type: ignore[no-untyped-def]
    """Agent.__init__ cleans up the host arena when a later step fails (here: the listen port is
    taken), but not the GPU arena it already allocated: its handle stays in tiers.gpu._local_arenas
    for good and the cudaMalloc'd block lives until the cyclic GC collects the half-built agent."""
    import socket

    from mooncake_store.agent.node import Agent

    busy = socket.create_server(("127.0.0.1", 0))
    try:
        port = busy.getsockname()[1]
        before = set(gpu_module._local_arenas)
        config = AgentConfig(
            node_id=f"half-{uuid.uuid4().hex[:6]}",
            host_bytes=4 * MiB,
            gpu_bytes=4 * MiB,
            listen=f"127.0.0.1:{port}",
            prefault=False,
        )
        with pytest.raises(MooncakeError, match="cannot listen"):
            Agent(config, redis_url=redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}")
        assert set(gpu_module._local_arenas) == before, "the half-built agent's GPU arena is still registered"
    finally:
        busy.close()
        gc.collect()  # frees the leaked arena (the half-built agent is in a reference cycle)
