"""The client's table of GPU segments without a device: an agent's IPC handle that will not open
(here: no CUDA runtime for its device) is a TransferError, which every fallback to TCP catches,
and is tried again after UNOPENABLE_RETRY_S instead of never. No cupy needed: the open fails first."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import node_row

from mooncake_store.client import device as device_module
from mooncake_store.client.device import GpuSegments
from mooncake_store.errors import TransferError
from mooncake_store.tiers.gpu_arrays import GpuUnavailable
from mooncake_store.types import NodeInfo, Replica, ReplicaState, TierKind, TierUsage, TransportKind

MiB = 1 << 20


def _gpu_node(handle_hex: str) -> NodeInfo:
    return node_row(
        "g",
        tiers=(TierUsage(tier=TierKind.GPU, capacity_bytes=MiB, used_bytes=0),),
        transports=(TransportKind.SHM, TransportKind.TCP),
        labels={"gpu_ipc": handle_hex, "gpu_id": "0"},
    )


def test_a_handle_that_would_not_open_is_tried_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA runtime for the agent's device (GpuUnavailable from local_device) used to escape as
    a non-TransferError, past every fallback to TCP; and one failed open was remembered for the
    client's life. Now both are a TransferError, asked again after UNOPENABLE_RETRY_S."""
    segments = GpuSegments()
    node = _gpu_node(bytes(64).hex())
    replica = Replica(node_id="g", tier=TierKind.GPU, offset=0, size_bytes=16, alloc_id=1, state=ReplicaState.COMPLETE)
    dest = np.zeros(16, np.uint8)
    calls: list[int] = []

    def no_runtime(device_id: int, pci_bus_id: str | None = None) -> int:
        calls.append(device_id)
        raise GpuUnavailable("CUDA runtime unavailable: the test's")

    monkeypatch.setattr(device_module, "local_device", no_runtime)
    for _ in range(2):
        with pytest.raises(TransferError, match="the test's"):
            segments.read(node, replica, dest.ctypes.data, 16)
    assert len(calls) == 1  # the second read did not ask again
    segments._unopenable = {k: (why, 0.0) for k, (why, _) in segments._unopenable.items()}  # the wait is over
    with pytest.raises(TransferError):
        segments.read(node, replica, dest.ctypes.data, 16)
    assert len(calls) == 2
    segments.close()


def test_no_mapping_is_opened_once_the_segments_are_closed() -> None:
    """Client.close() closes the GPU mappings while a loader thread may still read through them:
    one closed under a copy would send it to an address CUDA no longer knows. After close() no
    mapping is opened (here the open would fail for want of cupy, with another message)."""
    segments = GpuSegments()
    segments.close()
    node = _gpu_node(bytes(64).hex())
    replica = Replica(node_id="g", tier=TierKind.GPU, offset=0, size_bytes=16, alloc_id=1, state=ReplicaState.COMPLETE)
    dest = np.zeros(16, np.uint8)
    with pytest.raises(TransferError, match="the client is closed"):
        segments.read(node, replica, dest.ctypes.data, 16)
    assert segments.open_count() == 0


def test_handles_that_would_not_open_are_forgotten_with_their_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table of handles that would not open was never pruned: a long-lived client gained an
    entry per agent incarnation whose handle failed. retain() (the node table read) now drops
    those of agents no longer listed, and keeps those still listed."""
    segments = GpuSegments()
    gone, listed = _gpu_node(bytes(64).hex()), _gpu_node((b"\x01" * 64).hex())
    replica = Replica(node_id="g", tier=TierKind.GPU, offset=0, size_bytes=16, alloc_id=1, state=ReplicaState.COMPLETE)
    dest = np.zeros(16, np.uint8)

    def no_runtime(device_id: int, pci_bus_id: str | None = None) -> int:
        raise GpuUnavailable("CUDA runtime unavailable: the test's")

    monkeypatch.setattr(device_module, "local_device", no_runtime)
    for node in (gone, listed):
        with pytest.raises(TransferError):
            segments.read(node, replica, dest.ctypes.data, 16)
    assert len(segments._unopenable) == 2
    segments.retain({"g": listed})
    assert set(segments._unopenable) == {listed.labels["gpu_ipc"]}
    segments.close()
