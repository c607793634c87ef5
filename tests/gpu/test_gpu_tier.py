"""The GPU tier on a real CUDA device: arena round trips, CUDA IPC from another process, puts of
device arrays into the tier, device-to-device and host-to-device gets, demotion to host memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster
from mooncake_store.tiers.gpu import GpuArena, host_pointer

MiB = 1 << 20


@pytest.fixture
def cupy():  # type: ignore[no-untyped-def]
    import cupy

    return cupy


def test_arena_round_trip_host_and_device(cupy) -> None:  # type: ignore[no-untyped-def]
    arena = GpuArena(0, 16 * MiB)
    try:
        data = np.random.default_rng(0).integers(0, 255, 3 * MiB, dtype=np.uint8)
        arena.write_from_host(4096, memoryview(data))
        back = np.empty_like(data)
        arena.read_to_host(4096, memoryview(back))
        assert np.array_equal(back, data)
        dev = cupy.arange(MiB, dtype=cupy.uint8)
        arena.copy_within(8 * MiB, int(dev.data.ptr), MiB)
        out = np.empty(MiB, np.uint8)
        arena.read_to_host(8 * MiB, memoryview(out))
        assert np.array_equal(out, cupy.asnumpy(dev))
        assert host_pointer(memoryview(out)) != 0
    finally:
        arena.close()


def test_ipc_read_from_another_process() -> None:
    arena = GpuArena(0, 8 * MiB)
    try:
        data = np.arange(MiB, dtype=np.uint32).view(np.uint8)[: 2 * MiB]
        arena.write_from_host(0, memoryview(np.ascontiguousarray(data)))
        child = textwrap.dedent(
            f"""
            import numpy as np, sys
            from mooncake_store.tiers.gpu import GpuSegment, memcpy, host_pointer
            seg = GpuSegment(0, bytes.fromhex("{arena.ipc_handle.hex()}"), {8 * MiB})
            out = np.empty({2 * MiB}, np.uint8)
            memcpy(host_pointer(memoryview(out)), seg.pointer(0, out.nbytes), out.nbytes)
            seg.close()
            sys.stdout.write(str(int(out.view(np.uint32).sum(dtype=np.uint64))))
            """
        )
        got = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr
        assert int(got.stdout) == int(data.view(np.uint32).sum(dtype=np.uint64))
    finally:
        arena.close()


@pytest.fixture
def gpu_cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(64 * MiB), "--gpu-mem", str(32 * MiB)])
    return cluster


def test_device_put_lands_in_gpu_tier_and_reads_back(cupy, gpu_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    client: Client = make_client(gpu_cluster)
    x = cupy.random.standard_normal((64, 1024), dtype=cupy.float32)
    client.put("dev", x)
    meta = client.object_meta("dev")
    assert meta is not None and str(meta.replicas[0].tier) == "gpu"
    got = client.get("dev", device="cuda:0")  # device to device through CUDA IPC
    assert isinstance(got, cupy.ndarray) and got.dtype == cupy.float32 and got.shape == (64, 1024)
    assert bool(cupy.all(got == x))
    host = client.get("dev")  # through the agent: device to host, then TCP
    assert np.array_equal(host, cupy.asnumpy(x))
    out = cupy.empty_like(x)
    assert client.get_into("dev", out) == x.nbytes and bool(cupy.all(out == x))
    tcp_only = make_client(gpu_cluster, transports=("tcp",))
    assert np.array_equal(tcp_only.get("dev"), cupy.asnumpy(x))


def test_host_object_to_device_in_one_copy(cupy, gpu_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    client: Client = make_client(gpu_cluster)
    value = np.random.default_rng(1).standard_normal(MiB // 4).astype(np.float32)
    client.put("host-obj", value)
    assert str(client.object_meta("host-obj").replicas[0].tier) == "host"  # type: ignore[union-attr]
    got = client.get("host-obj", device=0)
    assert np.array_equal(cupy.asnumpy(got), value)


def test_gpu_pressure_demotes_to_host(cupy, make_cluster, make_client) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(128 * MiB), "--gpu-mem", str(16 * MiB)])
    client: Client = make_client(cluster, lease_ms=200, timeout_s=20)
    arrays = {f"g/{i}": cupy.full(MiB, i, dtype=cupy.uint8) for i in range(40)}
    for key, arr in arrays.items():
        client.put(key, arr)
    time.sleep(2.0)
    tiers = {key: str(client.object_meta(key).replicas[0].tier) for key in arrays}  # type: ignore[union-attr]
    assert "host" in tiers.values() and "gpu" in tiers.values()
    for key, arr in arrays.items():
        assert bool(cupy.all(client.get(key, device="cuda:0") == arr)), key
