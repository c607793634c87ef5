"""The GPU tier: one device buffer per agent, allocated with cudaMalloc through cupy, and shared
with same-host processes through a CUDA IPC handle.

cupy is imported lazily (optional extra ``gpu``) and everything here sits behind
:func:`cuda_status`, the capability check: without cupy or without a CUDA device the agent simply
has no GPU tier and the rest of the store runs unchanged.

Copies use ``cudaMemcpyAsync`` with ``cudaMemcpyDefault`` (unified addressing tells host and device
pointers apart), so one call serves host-to-device, device-to-host and device-to-device. A host
source or destination may be any buffer, the agent's shared-memory arena included: a same-host
``get(key, device="cuda:0")`` of a host-tier object is one copy from the arena into device memory.

Every copy is issued on the legacy default stream of the device that owns the device side and the
host waits for it before :func:`memcpy` returns. That wait is what makes the bytes safe to publish:
a device-to-device copy returns before it has run, and a host-to-device copy from pageable memory
returns once the source is staged, not written (CUDA runtime API, "API synchronization behavior").
Another process reading the arena through its IPC handle has no stream order with ours, so a put
must not commit, and a demotion must not swap, until the copy has landed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake_store.errors import InvalidValue, MooncakeError, NoCapacity, TransferError

#: cudaIpcMemLazyEnablePeerAccess: let a process on another GPU of the host open the handle.
IPC_LAZY_PEER_ACCESS = 1
#: cudaMemcpyDefault
MEMCPY_DEFAULT = 4
#: cudaStreamLegacy: the legacy default stream, whatever the caller's per-thread-stream setting.
STREAM_LEGACY = 1
#: sizeof(cudaIpcMemHandle_t)
IPC_HANDLE_BYTES = 64
BFLOAT16 = "bfloat16"


class GpuUnavailable(MooncakeError):
    """No usable CUDA device (cupy missing, no driver, or no such device)."""


@functools.cache
def _cupy() -> Any:
    try:
        import cupy  # optional dependency, imported on first use only
    except ImportError as exc:
        raise GpuUnavailable(f"cupy is not installed ({exc}); pip install 'mooncake-store[gpu]'") from None
    return cupy


def _cuda_error() -> type[BaseException]:
    """cupy's CUDARuntimeError (a RuntimeError)."""
    return getattr(_cupy().cuda.runtime, "CUDARuntimeError", RuntimeError)


def cuda_status(device_id: int = 0) -> tuple[bool, str]:
    """(usable, why): whether ``device_id`` can hold a GPU tier, in words either way."""
    try:
        cupy = _cupy()
        count = int(cupy.cuda.runtime.getDeviceCount())
    except GpuUnavailable as exc:
        return False, str(exc)
    except Exception as exc:  # cupy raises CUDARuntimeError when the driver is missing
        return False, f"CUDA runtime unavailable: {exc}"
    if count == 0:
        return False, "no CUDA device"
    if not 0 <= device_id < count:
        return False, f"CUDA device {device_id} does not exist; this host has {count}"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
    except Exception as exc:
        return False, f"CUDA device {device_id} is not usable: {exc}"
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return True, f"CUDA device {device_id}: {name}, {props['totalGlobalMem']} B"


_usable: set[int] = set()


def require_device(device_id: int) -> Any:
    """cupy, once ``device_id`` is known to be usable; GpuUnavailable (saying why) otherwise."""
    if device_id not in _usable:
        ok, why = cuda_status(device_id)
        if not ok:
            raise GpuUnavailable(f"CUDA device {device_id} is not usable: {why}")
        _usable.add(device_id)
    return _cupy()


@contextlib.contextmanager
def _on_device(device_id: int | None) -> Iterator[Any]:
    """Make ``device_id`` current in this thread (CUDA's current device is per thread)."""
    cupy = _cupy()
    if device_id is None:
        yield cupy
        return
    with cupy.cuda.Device(device_id):
        yield cupy


# ---- device arrays (cupy, CUDA torch tensors, anything with __cuda_array_interface__) --------------


def _is_torch(value: object) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def is_device_array(value: object) -> bool:
    """A cupy array, a CUDA torch tensor, or anything else exposing __cuda_array_interface__."""
    if _is_torch(value):
        # torch's __cuda_array_interface__ raises for tensors that require grad, describes bfloat16
        # as "<V2" and names no stream (version 2): ask the tensor itself instead.
        return bool(getattr(value, "is_cuda", False))
    try:
        getattr(value, "__cuda_array_interface__")  # noqa: B009 (a property that may raise)
    except Exception:
        return False
    return True


@dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """Where a device array's bytes are, after its producer's stream has been waited for."""

    pointer: int
    nbytes: int
    device_id: int
    dtype: str  # numpy's dtype.str, or "bfloat16"
    shape: tuple[int, ...]


def describe_device_array(value: Any) -> DeviceBuffer:
    """Pointer, size, device, dtype and shape of a C-contiguous device array.

    Waits for the stream the array's producer names (CUDA Array Interface v3: the consumer must
    synchronize it before touching the data), so pending kernels on a non-blocking stream have
    finished writing a source, or reading a destination, before we copy."""
    if _is_torch(value):
        return _describe_torch(value)
    try:
        iface = value.__cuda_array_interface__
    except Exception as exc:
        raise InvalidValue(f"{type(value).__name__} is not a device array: {exc}") from None
    if iface.get("mask") is not None:
        raise InvalidValue("masked device arrays are not storable")
    shape = tuple(int(d) for d in iface["shape"])
    try:
        dtype = np.dtype(iface["typestr"])
    except TypeError:
        raise InvalidValue(f"device array of typestr {iface['typestr']!r} is not storable") from None
    itemsize = dtype.itemsize
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    strides = iface.get("strides")
    if strides is not None and nbytes:
        step = itemsize
        for dim, stride in zip(reversed(shape), reversed(tuple(strides)), strict=True):
            if dim != 1 and stride != step:  # the stride of a length-1 axis is never used
                raise InvalidValue(f"device array of shape {shape} is not C-contiguous; pass a contiguous copy")
            step *= dim
    pointer = int(iface["data"][0]) if nbytes else 0
    cupy = _cupy()
    runtime = cupy.cuda.runtime
    try:
        device_id = int(runtime.pointerGetAttributes(pointer).device) if pointer else int(runtime.getDevice())
        if device_id < 0:  # managed or host memory seen through the interface: copy from here
            device_id = int(runtime.getDevice())
        stream = iface.get("stream")
        if stream:  # None: no stream order wanted; 0 is disallowed by the interface
            with cupy.cuda.Device(device_id):
                runtime.streamSynchronize(int(stream))
    except _cuda_error() as exc:
        raise TransferError(f"cannot use the device array at 0x{pointer:x}: {exc}") from None
    return DeviceBuffer(pointer, nbytes, device_id, dtype.str, shape)


def _describe_torch(tensor: Any) -> DeviceBuffer:
    import torch  # the caller handed us a tensor, so torch is there

    if not tensor.is_cuda:
        raise InvalidValue(f"torch tensor on {tensor.device} is not a device array")
    if not tensor.is_contiguous():
        raise InvalidValue(f"torch tensor of shape {tuple(tensor.shape)} is not contiguous; call .contiguous()")
    if tensor.dtype == torch.bfloat16:
        dtype = BFLOAT16
    else:
        try:
            dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype.str
        except TypeError:
            raise InvalidValue(f"torch dtype {tensor.dtype} is not storable") from None
    device_id = int(tensor.get_device())
    torch.cuda.current_stream(device_id).synchronize()
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    return DeviceBuffer(int(tensor.data_ptr()) if nbytes else 0, nbytes, device_id, dtype, tuple(tensor.shape))


def device_pointer(value: Any) -> tuple[int, int]:
    """(device pointer, nbytes) of a C-contiguous device array (see :func:`describe_device_array`)."""
    buf = describe_device_array(value)
    return buf.pointer, buf.nbytes


# ---- copies -----------------------------------------------------------------------------------------


def host_pointer(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def memcpy(dst_ptr: int, src_ptr: int, nbytes: int, device_id: int | None = None) -> None:
    """Copy ``nbytes`` between any two pointers (host or device) and wait until they have landed.

    ``device_id`` is the device that owns the device side of the copy; it is made current for the
    copy so that the stream waited for is the one the copy ran on."""
    if nbytes <= 0:
        return
    cuda_error = _cuda_error()
    try:
        with _on_device(device_id) as cupy:
            runtime = cupy.cuda.runtime
            runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, MEMCPY_DEFAULT, STREAM_LEGACY)
            runtime.streamSynchronize(STREAM_LEGACY)
    except cuda_error as exc:
        raise TransferError(f"CUDA copy of {nbytes} B (0x{src_ptr:x} -> 0x{dst_ptr:x}) failed: {exc}") from None


# ---- the agent's arena ------------------------------------------------------------------------------

#: IPC handle -> (base pointer, device) of the arenas this process owns. CUDA refuses to open an IPC
#: handle in the process that exported it ("invalid device context"), so a client sharing a process
#: with an agent uses the pointer directly.
_local_arenas: dict[bytes, tuple[int, int]] = {}
_local_lock = threading.Lock()


class GpuArena:
    """The agent side: ``size_bytes`` of device memory on ``device_id``, exported by IPC handle."""

    def __init__(self, device_id: int, size_bytes: int) -> None:
        ok, why = cuda_status(device_id)
        if not ok:
            raise GpuUnavailable(f"cannot create a GPU tier on device {device_id}: {why}")
        if size_bytes <= 0:
            raise InvalidValue(f"GPU tier size must be positive, got {size_bytes}")
        cupy = _cupy()
        self.device_id = device_id
        self.size_bytes = size_bytes
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(device_id):
            free, total = runtime.memGetInfo()
            if size_bytes > free:
                raise NoCapacity(f"need {size_bytes} B on GPU {device_id}; {free}/{total} B free")
            # cupy.cuda.Memory is one plain cudaMalloc, not a block of cupy's memory pool: an IPC
            # handle always exports a whole cudaMalloc allocation, and the importer maps its base.
            try:
                self._memory: Any = cupy.cuda.Memory(size_bytes)
            except (MemoryError, _cuda_error()) as exc:  # cupy's OutOfMemoryError is a MemoryError
                raise NoCapacity(f"need {size_bytes} B on GPU {device_id}: cudaMalloc failed: {exc}") from None
            self.base_ptr = int(self._memory.ptr)
            try:
                self.ipc_handle: bytes = bytes(runtime.ipcGetMemHandle(self.base_ptr))
            except _cuda_error() as exc:  # e.g. WSL, where CUDA IPC is not supported
                raise GpuUnavailable(f"CUDA IPC is not available on device {device_id}: {exc}") from None
            try:
                self.pci_bus_id = str(runtime.deviceGetPCIBusId(device_id))
            except _cuda_error():
                self.pci_bus_id = ""
        if len(self.ipc_handle) != IPC_HANDLE_BYTES:
            raise GpuUnavailable(f"CUDA IPC handle is {len(self.ipc_handle)} B, expected {IPC_HANDLE_BYTES}")
        with _local_lock:
            _local_arenas[self.ipc_handle] = (self.base_ptr, device_id)

    def _check(self, offset: int, length: int) -> int:
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise InvalidValue(f"range [{offset}, {offset + length}) is outside the {self.size_bytes} B GPU arena")
        return self.base_ptr + offset

    def write_from_host(self, offset: int, src: memoryview) -> None:
        memcpy(self._check(offset, src.nbytes), host_pointer(src), src.nbytes, self.device_id)

    def read_to_host(self, offset: int, dest: memoryview) -> None:
        memcpy(host_pointer(dest), self._check(offset, dest.nbytes), dest.nbytes, self.device_id)

    def copy_within(self, offset: int, src_ptr: int, nbytes: int) -> None:
        """Device-to-device (or host) copy from any pointer into the arena."""
        memcpy(self._check(offset, nbytes), src_ptr, nbytes, self.device_id)

    def close(self) -> None:
        memory, self._memory = self._memory, None
        if memory is None:
            return
        with _local_lock:
            _local_arenas.pop(self.ipc_handle, None)
        cupy = _cupy()
        with cupy.cuda.Device(self.device_id):
            with contextlib.suppress(Exception):
                cupy.cuda.runtime.deviceSynchronize()  # no copy of ours may still touch it
            del memory  # cudaFree, on the device that allocated it


class GpuSegment:
    """The client side: an agent's GPU arena opened through its IPC handle (same host only)."""

    def __init__(self, device_id: int, ipc_handle: bytes, size_bytes: int) -> None:
        if len(ipc_handle) != IPC_HANDLE_BYTES:
            raise InvalidValue(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} B, got {len(ipc_handle)}")
        cupy = _cupy()
        self.device_id = device_id
        self.size_bytes = size_bytes
        with _local_lock:
            local = _local_arenas.get(ipc_handle)
        self._ipc = local is None
        if local is not None:
            self.base_ptr, self.device_id = local
        else:
            try:
                with cupy.cuda.Device(device_id):
                    self.base_ptr = int(cupy.cuda.runtime.ipcOpenMemHandle(ipc_handle, IPC_LAZY_PEER_ACCESS))
            except _cuda_error() as exc:
                raise TransferError(f"cannot open a GPU arena's CUDA IPC handle on device {device_id}: {exc}") from None
        self._open = True

    def pointer(self, offset: int, length: int) -> int:
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise InvalidValue(f"range [{offset}, {offset + length}) is outside the {self.size_bytes} B GPU arena")
        return self.base_ptr + offset

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._ipc:
            cupy = _cupy()
            # cudaIpcCloseMemHandle needs the context it was opened in; a dead exporter is no error here.
            with contextlib.suppress(Exception), cupy.cuda.Device(self.device_id):
                cupy.cuda.runtime.ipcCloseMemHandle(self.base_ptr)


def local_device(device_id: int, pci_bus_id: str | None = None) -> int:
    """This process's index for an agent's GPU: by PCI bus id when known (CUDA_VISIBLE_DEVICES may
    number devices differently in the two processes), else by index, else the current device
    (cudaIpcOpenMemHandle maps handles of devices this process cannot see, through peer access)."""
    runtime = _cupy().cuda.runtime
    if pci_bus_id:
        with contextlib.suppress(Exception):
            return int(runtime.deviceGetByPCIBusId(pci_bus_id))
    try:
        count = int(runtime.getDeviceCount())
    except _cuda_error() as exc:
        raise GpuUnavailable(f"CUDA runtime unavailable: {exc}") from None
    return device_id if 0 <= device_id < count else int(runtime.getDevice())


def empty_device_array(nbytes: int, device: str | int) -> Any:
    """A uint8 cupy array of ``nbytes`` on ``device`` ("cuda:N" or N)."""
    device_id = parse_device(device)
    cupy = require_device(device_id)
    with cupy.cuda.Device(device_id):
        try:
            return cupy.empty(nbytes, dtype=cupy.uint8)
        except MemoryError as exc:  # cupy.cuda.memory.OutOfMemoryError
            raise NoCapacity(f"need {nbytes} B on GPU {device_id} for the result: {exc}") from None


def parse_device(device: str | int) -> int:
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    if device == "cuda":
        return 0
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isascii() and device[5:].isdigit():
        return int(device[5:])
    raise InvalidValue(f"device must be 'cuda', 'cuda:N' or a device index, got {device!r}")
