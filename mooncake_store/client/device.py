"""GPU paths of the client (DESIGN.md §4, "for the GPU tier, CUDA IPC handles").

- A device array put on a host whose agent has a GPU tier goes into that tier with one
  device-to-device copy through the agent's IPC handle; elsewhere it is staged to host memory.
- ``get(key, device="cuda:N")`` and ``get_into`` of a device array read a same-host GPU replica
  device-to-device, a same-host host replica with one host-to-device copy straight from the agent's
  shared arena, and anything else through TCP into host memory and then to the device.

This is the store's equivalent of ``pull_cache_async(prefix_id, target_gpu_id)``: a PrefixCache
hit's chunk keys and ``get_into(key, device_array)`` (or ``get_async``) with ``device="cuda:N"``.
Everything here is lazy: without cupy nothing in this module runs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mooncake_store.client.gets import LEASE_SAFETY
from mooncake_store.errors import ConnectError, InvalidValue, KeyNotFound, MooncakeError, TransferError
from mooncake_store.tiers.gpu import GpuSegment, device_pointer, empty_device_array, host_pointer, memcpy
from mooncake_store.transport.tcp import ReadRequest
from mooncake_store.types import NodeInfo, ObjectMeta, Replica, TierKind

if TYPE_CHECKING:
    from mooncake_store.client.client import Client


@dataclass(frozen=True, slots=True)
class DeviceSource:
    pointer: int
    size_bytes: int
    dtype: str
    shape: tuple[int, ...]
    keepalive: Any


def as_device_source(value: Any) -> DeviceSource:
    pointer, nbytes = device_pointer(value)
    iface = value.__cuda_array_interface__
    dtype = np.dtype(iface["typestr"])
    if dtype.kind not in "biufc":
        raise InvalidValue(f"device dtype {dtype} is not storable; use bool, int, uint, float or complex")
    return DeviceSource(pointer, nbytes, dtype.str, tuple(iface["shape"]), value)


def to_host(source: DeviceSource) -> np.ndarray:
    """One device-to-host copy, for paths that need host bytes (TCP, nodes without a GPU tier)."""
    out = np.empty(source.size_bytes, dtype=np.uint8)
    memcpy(host_pointer(memoryview(out)), source.pointer, source.size_bytes)
    return out.view(np.dtype(source.dtype)).reshape(source.shape)


def gpu_node(node: NodeInfo, host_id: str) -> bool:
    """A same-host node whose GPU tier this process can open through its IPC handle."""
    return node.host_id == host_id and "gpu_ipc" in node.labels and node.tier(TierKind.GPU) is not None


class GpuSegments:
    """IPC-opened GPU arenas of same-host agents, one per agent incarnation (handle)."""

    def __init__(self) -> None:
        self._segments: dict[str, GpuSegment] = {}
        self._lock = threading.Lock()

    def segment(self, node: NodeInfo) -> GpuSegment:
        handle_hex = node.labels["gpu_ipc"]
        with self._lock:
            seg = self._segments.get(handle_hex)
            if seg is None:
                usage = node.tier(TierKind.GPU)
                assert usage is not None
                seg = GpuSegment(int(node.labels.get("gpu_id", "0")), bytes.fromhex(handle_hex), usage.capacity_bytes)
                self._segments[handle_hex] = seg
            return seg

    def write(self, node: NodeInfo, replica: Replica, src_pointer: int, nbytes: int) -> None:
        memcpy(self.segment(node).pointer(replica.offset, nbytes), src_pointer, nbytes)

    def read(self, node: NodeInfo, replica: Replica, dest_pointer: int, nbytes: int) -> None:
        memcpy(dest_pointer, self.segment(node).pointer(replica.offset, nbytes), nbytes)

    def close(self) -> None:
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for seg in segments:
            seg.close()


def read_to_device(
    client: Client, key: str, *, out: Any = None, device: str | int | None = None
) -> tuple[ObjectMeta, Any]:
    """Read ``key`` into device memory: ``out`` (a device array) or a new buffer on ``device``.

    Same rules as host reads: one lookup with a lease, the cheapest replica first, and a read that
    outlived its lease is re-checked against the index before it counts."""
    config = client.config
    last_error: MooncakeError | None = None
    for attempt in range(config.max_retries + 1):
        started = time.monotonic()
        result = client.index.lookup([key], lease_ms=config.lease_ms)
        meta = result.objects[0]
        if meta is None:
            raise KeyNotFound(f"key {key!r} not found (no complete replica on a live node)")
        target = out if out is not None else empty_device_array(meta.size_bytes, device if device is not None else 0)
        pointer, capacity = device_pointer(target)
        if capacity < meta.size_bytes:
            raise InvalidValue(f"out holds {capacity} B but key {key!r} is {meta.size_bytes} B")
        nodes = client._node_table(refresh=attempt > 0)
        try:
            source = _read_replica_to_device(client, meta, nodes, pointer)
        except (TransferError, ConnectError) as exc:
            last_error = exc
            continue
        budget_s = LEASE_SAFETY * result.lease_left_ms(config.lease_ms) / 1000
        if time.monotonic() - started > budget_s and client._gets.outlived_lease([key], [meta], {0: source}, [0]):
            continue  # the replica read may have been freed meanwhile: read again
        return meta, target
    raise last_error or TransferError(f"could not read {key!r} into device memory: its replicas kept moving")


def _read_replica_to_device(client: Client, meta: ObjectMeta, nodes: dict[str, NodeInfo], dest: int) -> Replica | None:
    if meta.size_bytes == 0:
        return None
    n = meta.size_bytes

    def rank(replica: Replica) -> int:
        node = nodes.get(replica.node_id)
        if node is None:
            return 9
        if replica.tier == TierKind.GPU and gpu_node(node, client.host_id):
            return 0  # device to device through the agent's IPC handle
        if replica.tier == TierKind.HOST and client._use_shm(node):
            return 1  # host to device straight from the agent's shared arena
        return 2 + (replica.tier == TierKind.DISK)  # through the agent over TCP, then to the device

    errors = []
    for replica in sorted(meta.replicas, key=rank):
        node = nodes.get(replica.node_id)
        if node is None:
            continue
        try:
            how = rank(replica)
            if how == 0:
                client._gpu_segments().read(node, replica, dest, n)
            elif how == 1:
                seg = client._shm.segment(node.shm_name, client._arena_bytes(node))
                view = seg.view(replica.offset, n)
                try:
                    memcpy(dest, host_pointer(view), n)
                finally:
                    view.release()
            else:
                staging = np.empty(n, dtype=np.uint8)
                client._tcp.peer(node.tcp_endpoint).read_many(
                    [ReadRequest(alloc_id=replica.alloc_id, offset=replica.offset, dest=memoryview(staging))]
                )
                memcpy(dest, host_pointer(memoryview(staging)), n)
            return replica
        except (TransferError, ConnectError) as exc:
            errors.append(f"{replica.node_id}: {exc}")
    raise TransferError(f"every replica of {meta.key!r} failed: " + "; ".join(errors or ["none reachable"]))


def as_device_array(buffer: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    if dtype == "bfloat16":
        raise InvalidValue("cupy has no bfloat16: get_into a CUDA torch tensor of dtype bfloat16 instead")
    return buffer.view(np.dtype(dtype)).reshape(shape)
