"""The device paths' checks and bookkeeping, on a machine without CUDA: only the CUDA runtime is a
stand-in (tests/cuda_stand_in.py; for the IPC mappings, the GpuSegment that opens one), so the
shape checks, the client's table of IPC mappings and the read's autograd marking are the real code.
tests/gpu runs the same paths on a device."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import ClassVar

import numpy as np
import pytest
import torch
from cuda_stand_in import CudaTensorStandIn, HostBackedDeviceArray, HostRuntime, stand_in_cupy
from helpers import node_row

from mooncake_store import Client, InvalidValue, LocalCluster, connect
from mooncake_store.client import device as device_module
from mooncake_store.client.device import GpuSegments
from mooncake_store.errors import TransferError
from mooncake_store.tiers.gpu_arrays import describe_device_array
from mooncake_store.types import NodeInfo, Replica, ReplicaState, TierKind, TierUsage, TransportKind

MiB = 1 << 20
ARENA = np.arange(256, dtype=np.uint8)


@pytest.mark.parametrize("shape", [(2**62, 4), (3, 2**62), (2**32, 2**32)])
def test_a_shape_whose_size_passes_int64_is_refused_naming_it(shape: tuple[int, ...]) -> None:
    """numpy's int64 product wrapped: (2**62, 4) was an empty array (pointer 0, nothing read) and
    (3, 2**62) a negative size; a put of one failed in numpy's reshape with a ValueError."""
    with (
        stand_in_cupy(HostRuntime()),
        pytest.raises(InvalidValue, match=r"of shape .* would be \d+ B; no device holds"),
    ):
        describe_device_array(HostBackedDeviceArray(np.zeros(16, np.uint8), shape))


def test_a_device_array_past_the_dimension_limit_is_refused_as_a_host_one_is(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    client = make_client(make_cluster(1))
    with pytest.raises(InvalidValue, match="the limit is 32"):
        client.put("dims-host", np.zeros((2,) + (1,) * 32, np.uint8))
    with stand_in_cupy(HostRuntime()):
        for ndim in (33, 65):  # 65: past numpy's own limit, which its reshape met first
            with pytest.raises(InvalidValue, match=f"device array has {ndim} dimensions; the limit is 32"):
                client.put("dims-device", HostBackedDeviceArray(np.arange(2, dtype=np.uint8), (2,) + (1,) * (ndim - 1)))
    assert not client.exists("dims-device")


class StubMapping:
    """An IPC mapping whose opens and closes are recorded; its "device memory" is ARENA."""

    opened: ClassVar[list[StubMapping]] = []

    def __init__(self, device_id: int, handle: bytes, size_bytes: int) -> None:
        self.device_id = device_id
        self.closed = False
        StubMapping.opened.append(self)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        yield

    def pointer(self, offset: int, length: int) -> int:
        return int(ARENA.ctypes.data) + offset

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def mappings(monkeypatch: pytest.MonkeyPatch) -> list[StubMapping]:
    StubMapping.opened = []
    monkeypatch.setattr(device_module, "GpuSegment", StubMapping)
    monkeypatch.setattr(device_module, "local_device", lambda device_id, pci=None: 0)
    monkeypatch.setattr(device_module, "memcpy", lambda dst, src, n, dev=None: ctypes.memmove(dst, src, n))
    return StubMapping.opened


def _gpu_node_and_replica() -> tuple[NodeInfo, Replica]:
    node = node_row(
        "g",
        tiers=(TierUsage(tier=TierKind.GPU, capacity_bytes=MiB, used_bytes=0),),
        transports=(TransportKind.SHM, TransportKind.TCP),
        labels={"gpu_ipc": bytes(range(64)).hex(), "gpu_id": "0"},
    )
    replica = Replica(node_id="g", tier=TierKind.GPU, offset=16, size_bytes=16, alloc_id=1, state=ReplicaState.COMPLETE)
    return node, replica


def _read_through(table: GpuSegments) -> np.ndarray:
    node, replica = _gpu_node_and_replica()
    dest = np.zeros(16, np.uint8)
    table.read(node, replica, int(dest.ctypes.data), 16)
    return dest


def test_a_closed_client_opens_no_ipc_mapping(
    mappings: list[StubMapping], make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """close() closed the table of mappings only if one existed; a device read that looked its key
    up before close() made a fresh table at its first copy, and opened a mapping nothing closed."""
    client = make_client(make_cluster(1))
    client.close()
    with pytest.raises(TransferError, match="client is closed"):
        _read_through(client._gpu_segments())
    assert not [m for m in mappings if not m.closed]


def test_a_client_dropped_without_close_closes_its_ipc_mappings(
    mappings: list[StubMapping], make_cluster: Callable[..., LocalCluster]
) -> None:
    """Its host mappings were unmapped when it was collected; its IPC mappings stayed open for the
    life of the process, each keeping an agent's GPU arena resident."""
    cluster = make_cluster(1)
    client = connect(cluster.redis_url, namespace=cluster.namespace)
    client.get_many([])  # a first read starts what any get starts (the node table, its janitor)
    assert np.array_equal(_read_through(client._gpu_segments()), ARENA[16:32])
    assert len(mappings) == 1 and not mappings[0].closed
    alive = weakref.ref(client)
    del client
    gc.collect()
    assert alive() is None, "the dropped client was not collected"
    assert mappings[0].closed


def test_a_refused_cuda_out_is_not_marked_written(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """get_into bumped a CUDA destination's autograd version in a finally around the whole read, so
    a refusal (an out that requires grad) failed the backward of a graph that had saved it, though
    nothing was written. The CPU path refuses before its copy, and backward runs."""
    client = make_client(make_cluster(1))
    client.put("src", np.full(4, 5.0, dtype=np.float32))
    for out in (torch.zeros(4, requires_grad=True), torch.zeros(4).as_subclass(CudaTensorStandIn).requires_grad_()):
        weights = torch.ones(4, requires_grad=True)
        loss = (weights * out).sum()  # saves out for weights' gradient
        before = out._version
        with pytest.raises(InvalidValue, match="requires grad"):
            client.get_into("src", out)
        assert out._version == before
        loss.backward()  # nothing was written: the graph still holds
