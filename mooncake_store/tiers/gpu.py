"""The GPU tier: one device buffer per agent, allocated with cudaMalloc through cupy, and shared
with same-host processes through a CUDA IPC handle.

cupy is imported lazily (optional extra ``gpu``) and everything here sits behind
:func:`cuda_status`, the capability check: without cupy or without a CUDA device the agent simply
has no GPU tier and the rest of the store runs unchanged.

Copies use ``cudaMemcpy`` with ``cudaMemcpyDefault`` (unified addressing tells host and device
pointers apart), so one call serves host-to-device, device-to-host and device-to-device. A host
source or destination may be any buffer, the agent's shared-memory arena included: a same-host
``get(key, device="cuda:0")`` of a host-tier object is one copy from the arena into device memory.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mooncake_store.errors import InvalidValue, MooncakeError, NoCapacity

#: cudaIpcMemLazyEnablePeerAccess: let a process on another GPU of the host open the handle.
IPC_LAZY_PEER_ACCESS = 1
#: cudaMemcpyDefault
MEMCPY_DEFAULT = 4


class GpuUnavailable(MooncakeError):
    """No usable CUDA device (cupy missing, no driver, or no such device)."""


@functools.cache
def _cupy() -> Any:
    try:
        import cupy  # optional dependency, imported on first use only
    except ImportError as exc:
        raise GpuUnavailable(f"cupy is not installed ({exc}); pip install 'mooncake-store[gpu]'") from None
    return cupy


def cuda_status(device_id: int = 0) -> tuple[bool, str]:
    """(usable, why): whether ``device_id`` can hold a GPU tier, in words either way."""
    try:
        cupy = _cupy()
        count = int(cupy.cuda.runtime.getDeviceCount())
    except GpuUnavailable as exc:
        return False, str(exc)
    except Exception as exc:  # cupy raises CUDARuntimeError subclasses when the driver is missing
        return False, f"CUDA runtime unavailable: {exc}"
    if count == 0:
        return False, "no CUDA device"
    if not 0 <= device_id < count:
        return False, f"CUDA device {device_id} does not exist; this host has {count}"
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return True, f"CUDA device {device_id}: {name}, {props['totalGlobalMem']} B"


def is_device_array(value: object) -> bool:
    """A cupy array (or anything exposing __cuda_array_interface__, e.g. a CUDA torch tensor)."""
    return hasattr(value, "__cuda_array_interface__")


def device_pointer(value: Any) -> tuple[int, int]:
    """(device pointer, nbytes) of a C-contiguous device array."""
    iface = value.__cuda_array_interface__
    strides = iface.get("strides")
    shape = tuple(iface["shape"])
    itemsize = np.dtype(iface["typestr"]).itemsize
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    if strides is not None:
        expected = []
        step = itemsize
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if tuple(reversed(expected)) != tuple(strides) and nbytes:
            raise InvalidValue(f"device array of shape {shape} is not C-contiguous")
    return int(iface["data"][0]), nbytes


def host_pointer(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def memcpy(dst_ptr: int, src_ptr: int, nbytes: int) -> None:
    if nbytes:
        _cupy().cuda.runtime.memcpy(dst_ptr, src_ptr, nbytes, MEMCPY_DEFAULT)


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
        with cupy.cuda.Device(device_id):
            free, total = cupy.cuda.runtime.memGetInfo()
            if size_bytes > free:
                raise NoCapacity(f"need {size_bytes} B on GPU {device_id}; {free}/{total} B free")
            # cupy.cuda.Memory is a plain cudaMalloc (not the pool), which IPC handles require.
            self._memory = cupy.cuda.Memory(size_bytes)
            self.base_ptr = int(self._memory.ptr)
            self.ipc_handle: bytes = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.base_ptr))

    def _check(self, offset: int, length: int) -> int:
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise InvalidValue(f"range [{offset}, {offset + length}) is outside the {self.size_bytes} B GPU arena")
        return self.base_ptr + offset

    def write_from_host(self, offset: int, src: memoryview) -> None:
        memcpy(self._check(offset, len(src)), host_pointer(src), len(src))

    def read_to_host(self, offset: int, dest: memoryview) -> None:
        memcpy(host_pointer(dest), self._check(offset, len(dest)), len(dest))

    def copy_within(self, offset: int, src_ptr: int, nbytes: int) -> None:
        """Device-to-device (or host) copy from any pointer into the arena."""
        memcpy(self._check(offset, nbytes), src_ptr, nbytes)

    def close(self) -> None:
        self._memory = None  # cudaFree when cupy drops its last reference


class GpuSegment:
    """The client side: an agent's GPU arena opened through its IPC handle (same host only)."""

    def __init__(self, device_id: int, ipc_handle: bytes, size_bytes: int) -> None:
        cupy = _cupy()
        self.device_id = device_id
        self.size_bytes = size_bytes
        with cupy.cuda.Device(device_id):
            self.base_ptr = int(cupy.cuda.runtime.ipcOpenMemHandle(ipc_handle, IPC_LAZY_PEER_ACCESS))
        self._open = True

    def pointer(self, offset: int, length: int) -> int:
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise InvalidValue(f"range [{offset}, {offset + length}) is outside the {self.size_bytes} B GPU arena")
        return self.base_ptr + offset

    def close(self) -> None:
        if self._open:
            self._open = False
            _cupy().cuda.runtime.ipcCloseMemHandle(self.base_ptr)


def empty_device_array(nbytes: int, device: str | int) -> Any:
    """A uint8 cupy array of ``nbytes`` on ``device`` ("cuda:N" or N)."""
    device_id = parse_device(device)
    cupy = _cupy()
    with cupy.cuda.Device(device_id):
        return cupy.empty(nbytes, dtype=cupy.uint8)


def parse_device(device: str | int) -> int:
    if isinstance(device, int) and device >= 0:
        return device
    if isinstance(device, str) and device.startswith("cuda"):
        _, _, index = device.partition(":")
        if index == "" or index.isdigit():
            return int(index or 0)
    raise InvalidValue(f"device must be 'cuda', 'cuda:N' or a device index, got {device!r}")
