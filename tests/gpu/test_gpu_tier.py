"""The GPU tier on a real CUDA device: arena round trips, CUDA IPC from another process (both
directions), puts of device arrays into the tier, device-to-device, host-to-device and TCP-to-device
gets, CUDA torch tensors (bfloat16 included), demotion to host memory, spills to a peer's GPU tier.

Mostly copies on the device side (cupy.asarray / cupy.empty / cupy.asnumpy); a few checks (cupy.full
of a non-zero value, comparisons, .all(), cupy.arange) have cupy compile small kernels, so the
machine needs NVRTC as well as a driver (the lent H200 machine has it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import random_bytes, wait_until

from mooncake_store import Client, MooncakeError, connect
from mooncake_store.tiers.gpu import GpuArena, GpuSegment
from mooncake_store.tiers.gpu_arrays import memcpy

MiB = 1 << 20


def test_arena_round_trip_host_and_device(cupy) -> None:  # type: ignore[no-untyped-def]
    arena = GpuArena(0, 16 * MiB)
    try:
        assert len(arena.ipc_handle) == 64  # sizeof(cudaIpcMemHandle_t)
        data = random_bytes(3 * MiB, 0)
        arena.write_from_host(4096, memoryview(data))
        back = np.empty_like(data)
        arena.read_to_host(4096, memoryview(back))
        assert np.array_equal(back, data)
        # A multi-byte memoryview counts bytes, not items.
        floats = np.arange(1024, dtype=np.float32)
        arena.write_from_host(0, memoryview(floats))
        floats_back = np.empty_like(floats)
        arena.read_to_host(0, memoryview(floats_back))
        assert np.array_equal(floats_back, floats)
        dev = cupy.asarray(random_bytes(MiB, 1))  # device to device into the arena
        arena.copy_within(8 * MiB, int(dev.data.ptr), MiB)
        out = np.empty(MiB, np.uint8)
        arena.read_to_host(8 * MiB, memoryview(out))
        assert np.array_equal(out, cupy.asnumpy(dev))
        dev_out = cupy.empty(MiB, dtype=cupy.uint8)  # and back, device to device
        memcpy(int(dev_out.data.ptr), arena.base_ptr + 8 * MiB, MiB, 0)
        assert np.array_equal(cupy.asnumpy(dev_out), cupy.asnumpy(dev))
        with pytest.raises(MooncakeError, match="outside"):
            arena.read_to_host(16 * MiB - 10, memoryview(out))
    finally:
        arena.close()


def test_segment_in_the_exporting_process_uses_the_pointer() -> None:
    """CUDA refuses to open an IPC handle in the process that made it; a client that shares its
    process with an agent must get the arena's own pointer instead."""
    arena = GpuArena(0, 4 * MiB)
    try:
        seg = GpuSegment(0, arena.ipc_handle, arena.size_bytes)
        assert seg.pointer(0, 1) == arena.base_ptr
        seg.close()
    finally:
        arena.close()


def test_ipc_from_another_process_both_ways() -> None:
    arena = GpuArena(0, 8 * MiB)
    try:
        data = np.ascontiguousarray(np.arange(MiB, dtype=np.uint32).view(np.uint8)[: 2 * MiB])
        arena.write_from_host(0, memoryview(data))
        # The child opens the handle, reads the parent's bytes device-to-host and device-to-device,
        # then writes 1 MiB of its own into the arena (the direction of a client's put).
        child = textwrap.dedent(
            f"""
            import sys
            import numpy as np
            import cupy
            from mooncake_store.tiers.gpu import GpuSegment
            from mooncake_store.tiers.gpu_arrays import memcpy, host_pointer
            seg = GpuSegment(0, bytes.fromhex("{arena.ipc_handle.hex()}"), {8 * MiB})
            out = np.empty({2 * MiB}, np.uint8)
            memcpy(host_pointer(memoryview(out)), seg.pointer(0, out.nbytes), out.nbytes, 0)
            dev = cupy.empty({2 * MiB}, dtype=cupy.uint8)
            memcpy(int(dev.data.ptr), seg.pointer(0, out.nbytes), out.nbytes, 0)
            same = bool(np.array_equal(cupy.asnumpy(dev), out))
            mine = cupy.asarray(np.full({MiB}, 7, np.uint8))
            memcpy(seg.pointer({4 * MiB}, {MiB}), int(mine.data.ptr), {MiB}, 0)
            seg.close()
            sys.stdout.write(f"{{int(out.view(np.uint32).sum(dtype=np.uint64))}} {{same}}")
            """
        )
        got = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr
        total, same = got.stdout.split()
        assert int(total) == int(data.view(np.uint32).sum(dtype=np.uint64))
        assert same == "True"
        written = np.empty(MiB, np.uint8)
        arena.read_to_host(4 * MiB, memoryview(written))
        assert np.array_equal(written, np.full(MiB, 7, np.uint8))
    finally:
        arena.close()


def test_device_put_lands_in_gpu_tier_and_reads_back(cupy, gpu_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    client: Client = make_client(gpu_cluster)
    host_x = np.random.default_rng(2).standard_normal((64, 1024)).astype(np.float32)
    x = cupy.asarray(host_x)
    client.put("dev", x)
    meta = client.object_meta("dev")
    assert meta is not None and str(meta.replicas[0].tier) == "gpu"
    got = client.get("dev", device="cuda:0")  # device to device through CUDA IPC
    assert isinstance(got, cupy.ndarray) and got.dtype == cupy.float32 and got.shape == (64, 1024)
    assert np.array_equal(cupy.asnumpy(got), host_x)
    assert client._gpu is not None and client._gpu.open_count() == 1  # the IPC path, not TCP
    host = client.get("dev")  # device to host through the IPC handle: the agent serves no read
    assert np.array_equal(host, host_x)
    out = cupy.empty_like(x)
    assert client.get_into("dev", out) == x.nbytes
    assert np.array_equal(cupy.asnumpy(out), host_x)

    def agent_gpu_reads() -> int:
        return sum(t.reads for n in client.stat().nodes for t in n.tiers if t.tier == "gpu")

    time.sleep(1.5)  # counters reach the node table with the next heartbeat
    assert agent_gpu_reads() == 0
    tcp_only = make_client(gpu_cluster, transports=("tcp",))
    assert np.array_equal(tcp_only.get("dev"), host_x)
    via_tcp = tcp_only.get("dev", device=0)  # the agent reads device to host, TCP, then host to device
    assert np.array_equal(cupy.asnumpy(via_tcp), host_x)
    assert tcp_only._gpu is None  # a TCP-only client never opens the IPC handle
    assert wait_until(lambda: agent_gpu_reads() == 2, timeout_s=5), agent_gpu_reads()
    with pytest.raises(MooncakeError, match="out holds"):
        client.get_into("dev", cupy.empty(16, dtype=cupy.uint8))


def test_tcp_reads_of_gpu_replicas_at_any_offset(cupy, gpu_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    """The agent serves GPU replicas over TCP (host gets, TCP-only clients, other hosts): the read
    names the replica's offset in the GPU arena, which is not 0 for any object but the first."""
    client: Client = make_client(gpu_cluster)
    values = {f"at/{i}": random_bytes(4096 + i, 10 + i) for i in range(3)}
    for key, value in values.items():
        client.put(key, cupy.asarray(value))
    offsets = [client.object_meta(key).replicas[0].offset for key in values]  # type: ignore[union-attr]
    assert offsets[1] > 0 and offsets[2] > 0, offsets
    tcp_only = make_client(gpu_cluster, transports=("tcp",))
    for key, value in values.items():
        assert np.array_equal(client.get(key), value), key
        assert np.array_equal(cupy.asnumpy(tcp_only.get(key, device=0)), value), key


def test_host_object_to_device_in_one_copy(cupy, gpu_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    writer: Client = make_client(gpu_cluster)
    value = np.random.default_rng(1).standard_normal(MiB // 4).astype(np.float32)
    writer.put("host-obj", value)
    client: Client = make_client(gpu_cluster)  # a reader that has mapped no arena yet
    assert str(client.object_meta("host-obj").replicas[0].tier) == "host"  # type: ignore[union-attr]
    got = client.get("host-obj", device=0)
    assert np.array_equal(cupy.asnumpy(got), value)
    # The one copy is from the agent's shared arena, which the read mapped: not through the agent
    # over TCP, which would give the same bytes.
    (node,) = client._node_table().values()
    assert node.shm_name in client._shm._segments
    wrong = cupy.full(MiB // 2, 7, dtype=cupy.float16)  # as many bytes, another dtype: refused, untouched
    with pytest.raises(MooncakeError, match="holds <f4 but out has dtype <f2"):
        client.get_into("host-obj", wrong)
    assert bool((wrong == 7).all())
    raw = cupy.zeros(MiB, dtype=cupy.uint8)  # raw bytes take any dtype
    assert client.get_into("host-obj", raw) == MiB
    assert cupy.asnumpy(raw).tobytes() == value.tobytes()


def test_device_put_without_gpu_tier_is_staged_to_host(cupy, make_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(1)
    client: Client = make_client(cluster)
    host_x = random_bytes(MiB + 3, 3)
    client.put("staged", cupy.asarray(host_x))
    assert str(client.object_meta("staged").replicas[0].tier) == "host"  # type: ignore[union-attr]
    assert np.array_equal(client.get("staged"), host_x)
    assert np.array_equal(cupy.asnumpy(client.get("staged", device="cuda")), host_x)


def test_agent_in_the_client_process(cupy, make_inproc_agent, redis_url) -> None:  # type: ignore[no-untyped-def]
    agent = make_inproc_agent(host_bytes=16 * MiB, gpu_bytes=8 * MiB, reserve_timeout_s=10.0)
    with connect(redis_url, namespace=agent.namespace) as client:
        host_x = random_bytes(MiB, 4)
        client.put("here", cupy.asarray(host_x))
        assert str(client.object_meta("here").replicas[0].tier) == "gpu"  # type: ignore[union-attr]
        assert np.array_equal(cupy.asnumpy(client.get("here", device=0)), host_x)


def test_cuda_torch_tensors_bfloat16_included(cuda_torch, gpu_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    torch = cuda_torch
    client: Client = make_client(gpu_cluster)
    x = torch.randn(32, 256, device="cuda:0", dtype=torch.bfloat16)
    client.put("bf16", x)
    assert str(client.object_meta("bf16").replicas[0].tier) == "gpu"  # type: ignore[union-attr]
    out = torch.empty_like(x)
    assert client.get_into("bf16", out) == x.numel() * 2
    assert torch.equal(out, x)
    assert torch.equal(client.get("bf16"), x.cpu())  # host read: a CPU bfloat16 tensor
    with pytest.raises(MooncakeError, match="bfloat16"):
        client.get("bf16", device="cuda:0")  # cupy has no bfloat16
    y = torch.arange(1000, device="cuda:0", dtype=torch.int32)
    client.put("i32", y)
    assert np.array_equal(client.get("i32"), np.arange(1000, dtype=np.int32))


def test_gpu_pressure_demotes_to_host(cupy, make_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(128 * MiB), "--gpu-mem", str(16 * MiB)])
    client: Client = make_client(cluster, lease_ms=200, timeout_s=20)
    values = {f"g/{i}": np.full(MiB, i, dtype=np.uint8) for i in range(40)}
    for key, value in values.items():
        client.put(key, cupy.asarray(value))

    def tiers() -> set[str]:
        return {str(client.object_meta(key).replicas[0].tier) for key in values}  # type: ignore[union-attr]

    assert wait_until(lambda: {"host", "gpu"} <= tiers(), timeout_s=10), tiers()
    for key, value in values.items():
        assert np.array_equal(cupy.asnumpy(client.get(key, device="cuda:0")), value), key


def test_gpu_pressure_spills_to_the_peers_gpu_tier(cupy, make_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    """With no room in its own host tier, a GPU tier under pressure sends its coldest objects to the
    GPU tier of the peer with the most room there (a device-to-host copy, TCP, host-to-device)."""
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(4 * MiB), "--gpu-mem", str(16 * MiB)])
    cluster.add_agent(node_id="gpu-1", extra_args=["--host-bytes", str(4 * MiB), "--gpu-mem", str(128 * MiB)])
    client: Client = make_client(cluster, lease_ms=200, timeout_s=30)
    values = {f"g/{i}": random_bytes(MiB, i) for i in range(40)}
    for key, value in values.items():
        client.put(key, cupy.asarray(value), preferred_node="gpu-0")

    def places() -> dict[str, tuple[str, str]]:
        return {k: (m.replicas[0].node_id, str(m.replicas[0].tier)) for k in values if (m := client.object_meta(k))}

    assert wait_until(lambda: sum(p == ("gpu-1", "gpu") for p in places().values()) >= 10, timeout_s=15), places()
    for key, value in values.items():
        assert np.array_equal(cupy.asnumpy(client.get(key, device="cuda:0")), value), key
        assert np.array_equal(client.get(key), value), key

    def gpu_counters() -> dict[str, object]:
        return {n.node_id: n.tiers[0] for n in client.stat().nodes}

    moved = sum(p == ("gpu-1", "gpu") for p in places().values())
    assert wait_until(
        lambda: gpu_counters()["gpu-0"].spills_out >= moved and gpu_counters()["gpu-1"].spills_in >= moved,  # type: ignore[attr-defined]
        timeout_s=5,
    ), gpu_counters()
