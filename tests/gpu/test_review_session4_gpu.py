"""Review of d0f79f0 (the GPU tier's CUDA IPC path chosen by the transport policy): read paths that
used a transport the client was told not to use, or probed CUDA where no IPC path can apply (fixed
since; these keep them fixed). Like
test_gpu_tier.py, these run only where cupy sees a CUDA device (tests/gpu/conftest.py skips them
elsewhere)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mooncake_store.client.device as device_module
import mooncake_store.tiers.gpu_arrays as gpu_arrays
from mooncake_store import Client, MooncakeError
from mooncake_store.errors import TransferError

MiB = 1 << 20


def _put_gpu_object(cupy: Any, client: Client, key: str) -> np.ndarray:
    value = np.random.default_rng(7).integers(0, 256, 64 * 1024, dtype=np.uint8)
    client.put(key, cupy.asarray(value))
    meta = client.object_meta(key)
    assert meta is not None and str(meta.replicas[0].tier) == "gpu"
    return value


class _UnopenableSegment:
    """Stands in for GpuSegment where the agent's IPC handle will not open in this process (another
    container, no peer access): GpuSegments turns this into a remembered TransferError."""

    def __init__(self, *args: object) -> None:
        raise TransferError("cannot open a GPU arena's CUDA IPC handle here (review stand-in)")


def _spy_tcp(client: Client) -> list[str]:
    """Record every agent connection the client asks for."""
    endpoints: list[str] = []
    real_peer = client._tcp.peer

    def peer(endpoint: str) -> Any:
        endpoints.append(endpoint)
        return real_peer(endpoint)

    client._tcp.peer = peer  # type: ignore[method-assign]
    return endpoints


@pytest.mark.parametrize("device", [None, 0], ids=["host-read", "device-read"])
def test_shm_only_read_does_not_fall_back_to_tcp_when_ipc_fails(
    cupy, gpu_cluster, make_client, monkeypatch, device
) -> None:  # type: ignore[no-untyped-def]
    """gets.py _read_gpu_ipc (host reads) and device.py _read_replica_to_device (device reads) fell
    back to the agent over TCP whatever client.transports said, when the CUDA IPC handle did not
    open. Before d0f79f0 a shm-only client never read a GPU replica over TCP (the policy left it
    out: no allowed path); then the policy gave it SHM (CUDA IPC) and the fallback went over TCP."""
    writer: Client = make_client(gpu_cluster)
    _put_gpu_object(cupy, writer, "dev")
    shm_only: Client = make_client(gpu_cluster, transports=("shm",))
    monkeypatch.setattr(device_module, "GpuSegment", _UnopenableSegment)
    tcp_calls = _spy_tcp(shm_only)
    with pytest.raises(MooncakeError):
        shm_only.get("dev") if device is None else shm_only.get("dev", device=device)
    assert tcp_calls == [], f"a shm-only client read over TCP from {tcp_calls}"


def test_tcp_only_host_read_of_a_gpu_replica_does_not_probe_cuda(cupy, gpu_cluster, make_client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """GetPath._order asks _cuda_usable() (imports cupy, cudaGetDeviceCount) for every replica list
    holding a GPU replica, even when no CUDA IPC path can apply (shm not allowed, or the node on
    another host). The parent's _gpu_ipc_reaches probed CUDA only after the cheap checks passed."""
    writer: Client = make_client(gpu_cluster)
    value = _put_gpu_object(cupy, writer, "dev")
    tcp_only: Client = make_client(gpu_cluster, transports=("tcp",))
    probes: list[int] = []
    real_status = gpu_arrays.cuda_status

    def counting_status(device_id: int = 0) -> tuple[bool, str]:
        probes.append(device_id)
        return real_status(device_id)

    monkeypatch.setattr(gpu_arrays, "cuda_status", counting_status)
    assert np.array_equal(tcp_only.get("dev"), value)
    assert probes == [], "a TCP-only host read probed CUDA"
