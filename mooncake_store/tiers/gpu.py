"""The GPU tier: one device buffer per agent, allocated with cudaMalloc through cupy, and shared
with same-host processes through a CUDA IPC handle.

cupy, the capability check and the copies issued here live in :mod:`mooncake_store.tiers.gpu_arrays`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from mooncake_store.errors import InvalidValue, NoCapacity, TransferError
from mooncake_store.tiers.gpu_arrays import GpuUnavailable, _cuda_error, _cupy, cuda_status, host_pointer, memcpy

#: cudaIpcMemLazyEnablePeerAccess: let a process on another GPU of the host open the handle.
IPC_LAZY_PEER_ACCESS = 1
#: sizeof(cudaIpcMemHandle_t)
IPC_HANDLE_BYTES = 64


# ---- the agent's arena ------------------------------------------------------------------------------

#: IPC handle -> (base pointer, device) of the arenas this process owns. CUDA refuses to open an IPC
#: handle in the process that exported it ("invalid device context"), so a client sharing a process
#: with an agent uses the pointer directly.
_local_arenas: dict[bytes, GpuArena] = {}
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
        try:
            # The first call that needs the device's context, which cuda_status's property query
            # does not: a GPU full from another process or held in exclusive mode fails here.
            with cupy.cuda.Device(device_id):
                free, total = runtime.memGetInfo()
        except _cuda_error() as exc:
            raise GpuUnavailable(f"cannot create a GPU tier on device {device_id}: CUDA refused it: {exc}") from None
        with cupy.cuda.Device(device_id):
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
        #: Held by close() around the free and by this process's own segments around each copy:
        #: a copy through a segment never touches the arena after it is freed.
        self.lock = threading.Lock()
        with _local_lock:
            _local_arenas[self.ipc_handle] = self

    def _check(self, offset: int, length: int) -> int:
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise InvalidValue(f"range [{offset}, {offset + length}) is outside the {self.size_bytes} B GPU arena")
        return self.base_ptr + offset

    def write_from_host(self, offset: int, src: memoryview) -> None:
        self._copy(self._check(offset, src.nbytes), host_pointer(src), src.nbytes)

    def read_to_host(self, offset: int, dest: memoryview) -> None:
        self._copy(host_pointer(dest), self._check(offset, dest.nbytes), dest.nbytes)

    def copy_within(self, offset: int, src_ptr: int, nbytes: int) -> None:
        """Device-to-device (or host) copy from any pointer into the arena."""
        self._copy(self._check(offset, nbytes), src_ptr, nbytes)

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        """One copy of the agent's own, under the lock close() frees the arena under: a copy that
        raced close() (a read served while the agent stopped) went through a freed device pointer,
        which another allocation of this process may hold by then."""
        with self.lock:
            if self._memory is None:
                raise TransferError(f"the GPU arena on device {self.device_id} was closed")
            memcpy(dst, src, nbytes, self.device_id)

    @property
    def closed(self) -> bool:
        return self._memory is None

    def close(self) -> None:
        with _local_lock:
            _local_arenas.pop(self.ipc_handle, None)
        with self.lock:
            memory, self._memory = self._memory, None
            if memory is None:
                return
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
        # CUDA refuses to open a handle in the process that exported it: this process's own arena
        # is used directly, and each copy holds its lock (the arena may be closed meanwhile).
        self._local = local
        self._ipc = local is None
        if local is not None:
            self.base_ptr, self.device_id = local.base_ptr, local.device_id
        else:
            try:
                with cupy.cuda.Device(device_id):
                    self.base_ptr = int(cupy.cuda.runtime.ipcOpenMemHandle(ipc_handle, IPC_LAZY_PEER_ACCESS))
            except _cuda_error() as exc:
                raise TransferError(f"cannot open a GPU arena's CUDA IPC handle on device {device_id}: {exc}") from None
        self._open = True

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Around each copy through this segment: for this process's own arena, its lock, and an
        error (not a copy into freed memory) once it is closed."""
        if self._local is None:
            if not self._open:  # its owner closes it only once no copy holds it: a caller's bug
                raise TransferError(f"the GPU mapping at 0x{self.base_ptr:x} was closed")
            yield
            return
        with self._local.lock:
            if self._local.closed or not self._open:
                raise TransferError(f"the GPU arena at 0x{self.base_ptr:x} was closed")
            yield

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
    number devices differently in the two processes), else by index, else device 0
    (cudaIpcOpenMemHandle maps handles of devices this process cannot see, through peer access).
    Device 0 rather than the thread's current device: that one is per thread, and a segment
    cached for the process must be opened in one context whichever thread asked first."""
    runtime = _cupy().cuda.runtime
    if pci_bus_id:
        with contextlib.suppress(Exception):
            return int(runtime.deviceGetByPCIBusId(pci_bus_id))
    try:
        count = int(runtime.getDeviceCount())
    except _cuda_error() as exc:
        raise GpuUnavailable(f"CUDA runtime unavailable: {exc}") from None
    if count <= 0:
        raise GpuUnavailable("CUDA sees no device in this process")
    return device_id if 0 <= device_id < count else 0
