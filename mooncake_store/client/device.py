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
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mooncake_store.client.buffers import BFLOAT16, bump_version, check_dtype, check_fill_dtype, typed_view
from mooncake_store.client.gets import LEASE_SAFETY, RACED, lookup, refuse_stale_shm
from mooncake_store.client.lease_clock import lease_clock_s
from mooncake_store.errors import ConnectError, InvalidValue, KeyNotFound, MooncakeError, TransferError
from mooncake_store.policy.transport_choice import order_replicas
from mooncake_store.tiers.gpu import GpuSegment, local_device
from mooncake_store.tiers.gpu_arrays import (
    describe_device_array,
    empty_device_array,
    host_pointer,
    is_torch_tensor,
    memcpy,
    parse_device,
)
from mooncake_store.transport.tcp import ReadRequest
from mooncake_store.types import NodeInfo, ObjectMeta, Replica, TierKind, TransportKind, shown_key

if TYPE_CHECKING:
    from mooncake_store.client.client import Client

#: A GPU arena's IPC handle that would not open is tried again after this long.
UNOPENABLE_RETRY_S = 30.0


@dataclass(frozen=True, slots=True)
class DeviceSource:
    pointer: int
    size_bytes: int
    dtype: str
    shape: tuple[int, ...]
    keepalive: Any
    device_id: int = 0


def as_device_source(value: Any) -> DeviceSource:
    buf = describe_device_array(value)
    dtype = buf.dtype if buf.dtype == BFLOAT16 else check_dtype(np.dtype(buf.dtype))
    return DeviceSource(buf.pointer, buf.nbytes, dtype, buf.shape, value, buf.device_id)


def to_host_bytes(source: DeviceSource) -> np.ndarray:
    """The source's bytes in host memory (uint8), in one device-to-host copy."""
    out = np.empty(source.size_bytes, dtype=np.uint8)
    memcpy(host_pointer(memoryview(out)), source.pointer, source.size_bytes, source.device_id)
    return out


def to_host(source: DeviceSource) -> Any:
    """One device-to-host copy, for paths that need host bytes (TCP, nodes without a GPU tier)."""
    out = to_host_bytes(source)
    if source.dtype == BFLOAT16:
        import torch  # a bfloat16 device source is a CUDA torch tensor, so torch is there

        return torch.from_numpy(out.view(np.int16).reshape(source.shape)).view(torch.bfloat16)
    return out.view(np.dtype(source.dtype)).reshape(source.shape)


class GpuSegments:
    """IPC-opened GPU arenas of same-host agents, one per agent (the handle names its incarnation).

    When an agent comes back with a new arena, the old mapping is closed as soon as no copy is
    using it, so a long-lived client does not keep dead arenas mapped."""

    def __init__(self) -> None:
        self._segments: dict[str, tuple[str, GpuSegment]] = {}  # node id -> (handle hex, segment)
        self._busy: dict[int, int] = {}  # id(segment) -> copies in flight
        self._retired: list[GpuSegment] = []
        #: handle hex -> (why it would not open, when to try again (monotonic s))
        self._unopenable: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._closed = False
        # A table dropped without close() (its client collected unclosed) closes its mappings:
        # each may keep a dead agent's arena resident for the life of the process (a stopping
        # agent frees its arena regardless, which CUDA leaves undefined). No copy can be using
        # one then (a copy holds the table). Not at exit, when CUDA may be torn down already.
        self._finalizer = weakref.finalize(self, _close_mappings, self._segments, self._retired)
        self._finalizer.atexit = False

    def _acquire(self, node: NodeInfo) -> GpuSegment:
        handle_hex = node.labels["gpu_ipc"]
        with self._lock:
            if self._closed:
                raise TransferError("the client is closed: its GPU mappings are closed")
            known = self._segments.get(node.node_id)
            if known is not None and known[0] == handle_hex:
                seg = known[1]
                self._busy[id(seg)] = self._busy.get(id(seg), 0) + 1
                return seg
            failed = self._unopenable.get(handle_hex)
        if failed is not None and time.monotonic() < failed[1]:
            raise TransferError(failed[0])
        usage = node.tier(TierKind.GPU)
        if usage is None:
            raise TransferError(f"node {node.node_id} publishes no GPU tier")
        try:
            handle = bytes.fromhex(handle_hex)
            gpu_id = int(node.labels.get("gpu_id", "0"))
        except ValueError:
            raise TransferError(f"node {node.node_id} publishes a malformed CUDA IPC handle or GPU id") from None
        try:
            device_id = local_device(gpu_id, node.labels.get("gpu_pci"))
            seg = GpuSegment(device_id, handle, usage.capacity_bytes)
        except MooncakeError as exc:  # GpuUnavailable too: callers fall back on TransferError only
            why = f"node {node.node_id}: {exc}"
            with self._lock:
                # Not asked again for a while (each try costs a CUDA call), but not forever: the
                # cause may pass (device memory, a peer limit).
                self._unopenable[handle_hex] = (why, time.monotonic() + UNOPENABLE_RETRY_S)
            raise TransferError(why) from None
        closed = False
        with self._lock:
            known = self._segments.get(node.node_id)
            if self._closed:  # close() ran while this thread opened it: nobody else would close it
                duplicate, closed = seg, True
            elif known is not None and known[0] == handle_hex:  # another thread opened it meanwhile
                duplicate, seg = seg, known[1]
            else:
                duplicate = None
                if known is not None:
                    self._retire(known[1])
                self._segments[node.node_id] = (handle_hex, seg)
            if not closed:
                self._busy[id(seg)] = self._busy.get(id(seg), 0) + 1
        if duplicate is not None:
            duplicate.close()  # CUDA counts opens of one handle per context: this undoes ours only
        if closed:
            raise TransferError("the client is closed: its GPU mappings are closed")
        return seg

    def _retire(self, seg: GpuSegment) -> None:
        """Under the lock: close ``seg`` now if idle, else when its last copy ends."""
        if self._busy.get(id(seg), 0):
            self._retired.append(seg)
        else:
            self._busy.pop(id(seg), None)
            seg.close()

    def _release(self, seg: GpuSegment) -> None:
        with self._lock:
            left = self._busy.get(id(seg), 1) - 1
            self._busy[id(seg)] = left
            if left <= 0 and seg in self._retired:
                self._retired.remove(seg)
                self._busy.pop(id(seg), None)
                seg.close()

    def write(self, node: NodeInfo, replica: Replica, src_pointer: int, nbytes: int) -> None:
        seg = self._acquire(node)
        try:
            with seg.in_use():
                memcpy(seg.pointer(replica.offset, nbytes), src_pointer, nbytes, seg.device_id)
        finally:
            self._release(seg)

    def read(self, node: NodeInfo, replica: Replica, dest_pointer: int, nbytes: int) -> None:
        seg = self._acquire(node)
        try:
            with seg.in_use():
                memcpy(dest_pointer, seg.pointer(replica.offset, nbytes), nbytes, seg.device_id)
        finally:
            self._release(seg)

    def retain(self, nodes: Mapping[str, NodeInfo]) -> None:
        """Close the mappings of agents no longer in the node table (stopped, or reaped), as soon
        as no copy uses them: on a real device each keeps a dead agent's arena resident. Handles
        that would not open are forgotten with their agents (one entry per incarnation, else)."""
        handles = {n.labels.get("gpu_ipc") for n in nodes.values()}
        with self._lock:
            for node_id in [n for n in self._segments if n not in nodes]:
                _, seg = self._segments.pop(node_id)
                self._retire(seg)
            for handle_hex in [h for h in self._unopenable if h not in handles]:
                del self._unopenable[handle_hex]

    def open_count(self) -> int:
        with self._lock:
            return len(self._segments)

    def close(self) -> None:
        """Close every mapping; one a copy in another thread is using closes when that copy ends
        (unmapped under it, the copy would go to an address CUDA no longer knows, which
        cudaMemcpyDefault takes for host memory). No mapping is opened after this."""
        with self._lock:
            self._closed = True
            segments = [seg for _, seg in self._segments.values()]
            self._segments.clear()  # the very dict the finalizer holds
            for seg in segments:
                self._retire(seg)


def _close_mappings(segments: dict[str, tuple[str, GpuSegment]], retired: list[GpuSegment]) -> None:
    """The finalizer of a GpuSegments collected without close(): every mapping it still held."""
    for _, seg in list(segments.values()):
        seg.close()
    for seg in list(retired):
        seg.close()


def read_to_device(
    client: Client, key: str, *, out: Any = None, device: str | int | None = None
) -> tuple[ObjectMeta, Any]:
    """Read ``key`` into device memory: ``out`` (a device array) or a new buffer on ``device``.

    Same rules as host reads: one lookup with a lease, the cheapest replica first, and a read that
    outlived its lease is re-checked against the index before it counts."""
    client._check_open()
    copying: list[bool] = []  # appended to once a copy into ``out`` may have begun
    try:
        return _read_to_device(client, key, out=out, device=device, copying=copying)
    except MooncakeError as exc:
        client._raise_if_interrupted(exc)  # cut short by close(): "client is closed"
        raise
    finally:
        if copying and out is not None and is_torch_tensor(out):
            # Written behind autograd's back (a failed read may have written part of it): bumped
            # as a CPU tensor's is (buffers.mark_written), so a backward that saved it refuses.
            # Not for a refusal before any copy (an out that requires grad, a wrong dtype, a
            # missing key): nothing was written, and the bump failed a backward that saved it.
            bump_version(out)


def _read_to_device(
    client: Client, key: str, *, out: Any, device: str | int | None, copying: list[bool]
) -> tuple[ObjectMeta, Any]:
    if out is None and device is not None:
        parse_device(device)  # a bad device is InvalidValue whether or not the key exists
    config = client.config
    last_error: MooncakeError | None = None
    target: Any = None
    for attempt in range(config.max_retries + 1):
        client._check_open()  # a retry after close() cut this read short: none
        started = lease_clock_s()
        result = lookup(client, [key], attempt)  # counted once per get
        meta = result.objects[0]
        if meta is None:
            raise KeyNotFound(f"key {shown_key(key)} not found (no complete replica on a live node)", key=key)
        if out is not None:
            target = out
        elif meta.dtype == BFLOAT16:
            raise InvalidValue(
                f"key {key!r} holds bfloat16, which cupy lacks: get_into a CUDA torch tensor of dtype bfloat16"
            )
        elif target is None or target.nbytes != meta.size_bytes:  # the key may be replaced between attempts
            target = empty_device_array(meta.size_bytes, device if device is not None else 0)
        dest = describe_device_array(target, for_writing=True)
        check_fill_dtype(key, meta.dtype, dest.dtype)
        if dest.nbytes < meta.size_bytes:
            raise InvalidValue(f"out holds {dest.nbytes} B but key {key!r} is {meta.size_bytes} B")
        nodes = client._nodes_for(meta.replicas, client._node_table(refresh=attempt > 0))
        copying.append(True)
        try:
            source = _read_replica_to_device(client, meta, nodes, dest.pointer, dest.device_id)
        except (TransferError, ConnectError) as exc:
            last_error = exc
            continue
        budget_s = LEASE_SAFETY * result.lease_left_ms(config.lease_ms) / 1000
        if lease_clock_s() - started > budget_s and client._gets.outlived_lease([key], [meta], {0: source}, [0]):
            continue  # the replica read may have been freed meanwhile: read again
        return meta, target
    raise last_error or TransferError(
        f"could not read {key!r} into device memory after {config.max_retries + 1} attempts: {RACED} "
        f"(lease_ms={config.lease_ms})"
    )


def _read_replica_to_device(
    client: Client, meta: ObjectMeta, nodes: dict[str, NodeInfo], dest: int, dest_device: int
) -> Replica | None:
    if meta.size_bytes == 0:
        return None
    n = meta.size_bytes
    # Device to device through the agent's IPC handle first, then host to device straight from a
    # same-host arena, then through the agent over TCP (DESIGN.md §4; a device destination implies
    # CUDA here, so the IPC handle is usable).
    ordered = order_replicas(
        meta.replicas,
        nodes,
        allowed=client.transports,
        host_id=client.host_id,
        shm_names_reachable=client._gets._reachable_segments(nodes),
        cuda_ipc=True,
        to_device=True,
    )

    def through_agent(node: NodeInfo, replica: Replica) -> None:
        staging = np.empty(n, dtype=np.uint8)
        client._tcp.peer(node.tcp_endpoint).read_many(
            [ReadRequest(alloc_id=replica.alloc_id, offset=replica.offset, dest=memoryview(staging))]
        )
        memcpy(dest, host_pointer(memoryview(staging)), n, dest_device)

    errors = []
    for replica, node, kind in ordered:
        try:
            refuse_stale_shm(meta.key, replica, node, kind)
            if kind == TransportKind.SHM and replica.tier == TierKind.GPU:
                try:
                    client._gpu_segments().read(node, replica, dest, n)
                except TransferError as exc:
                    # The handle would not open here (no peer access, another container...): the
                    # agent can still serve the replica device to host.
                    errors.append(f"{replica.node_id} via CUDA IPC: {exc}")
                    if TransportKind.TCP not in client.transports:
                        raise  # no other way to this replica: the next one
                    through_agent(node, replica)
            elif kind == TransportKind.SHM:
                try:
                    seg = client._shm.segment(node.shm_name, client._arena_bytes(node))
                except ConnectError:  # cannot be mapped here (no room, no descriptor): the agent serves it
                    if TransportKind.TCP not in client.transports:
                        raise
                    through_agent(node, replica)
                    return replica
                if client.config.pin_shared_arenas:
                    seg.pin_for_devices(dest_device)
                try:
                    with seg.device_view(replica.offset, n) as view:
                        memcpy(dest, host_pointer(view), n, dest_device)
                except MooncakeError as exc:
                    if not seg.closed:
                        raise
                    # Unmapped meanwhile (its agent left the node table): the next replica, if any.
                    raise TransferError(f"{node.shm_name} was unmapped during the read: {exc}") from None
            else:
                through_agent(node, replica)
            return replica
        except (TransferError, ConnectError) as exc:
            errors.append(f"{replica.node_id}: {exc}")
            client._tcp.drop_peer_after(node.tcp_endpoint, exc)
    raise TransferError(f"every replica of {meta.key!r} failed: " + "; ".join(errors or ["none reachable"]))


def as_device_array(buffer: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    if dtype == BFLOAT16:
        raise InvalidValue("cupy has no bfloat16: get_into a CUDA torch tensor of dtype bfloat16 instead")
    return typed_view(buffer, dtype, shape)
