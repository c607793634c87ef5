"""CUDA device arrays and copies through cupy: the capability check, the description of a caller's
device array, and the one copy primitive shared by the GPU tier (:mod:`mooncake_store.tiers.gpu`)
and the client's device gets and puts.

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

The legacy stream is also what orders a copy after the caller's work: it waits for everything
queued before it on the default stream and on every blocking stream, whichever thread queued it.
A copy on a non-blocking stream of our own would let a loader thread read while a forward pass
runs, but nothing would then order it after the kernels that wrote its source or still read its
destination: the CUDA Array Interface's "stream" names the stream current in the thread that asks
(cupy), or nothing at all (numba's default stream), never the producer's. That was tried and
withdrawn (README, "GPU tier, open questions"); overlap needs the caller to name its stream.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake_store.errors import GpuUnavailable, InvalidValue, NoCapacity, TransferError
from mooncake_store.types import MAX_DIMS

log = logging.getLogger(__name__)

#: cudaMemcpyDefault
MEMCPY_DEFAULT = 4
#: cudaStreamLegacy: the legacy default stream, whatever the caller's per-thread-stream setting.
STREAM_LEGACY = 1
BFLOAT16 = "bfloat16"
#: cudaHostRegisterPortable: the range counts as pinned in every CUDA context of the process.
HOST_REGISTER_PORTABLE = 1
#: Larger than any device's memory (and than a size_t on the wire): a shape describing more is a
#: malformed interface, not an array.
MAX_DEVICE_BYTES = (1 << 63) - 1


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


def is_torch_tensor(value: object) -> bool:
    """A torch tensor (CPU or CUDA), told apart without importing torch."""
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def is_device_array(value: object) -> bool:
    """A cupy array, a CUDA torch tensor, or anything else exposing __cuda_array_interface__."""
    if is_torch_tensor(value):
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


def describe_device_array(value: Any, *, for_writing: bool = False) -> DeviceBuffer:
    """Pointer, size, device, dtype and shape of a C-contiguous device array; ``for_writing``
    refuses one whose interface says it is read-only, as a read-only host buffer is refused.

    Waits for the stream the array's producer names (CUDA Array Interface v3: the consumer must
    synchronize it before touching the data), so pending kernels on a non-blocking stream have
    finished writing a source, or reading a destination, before we copy."""
    if is_torch_tensor(value):
        return _describe_torch(value, for_writing=for_writing)
    try:
        iface = value.__cuda_array_interface__
    except Exception as exc:
        raise InvalidValue(f"{type(value).__name__} is not a device array: {exc}") from None
    shape, dtype, pointer, readonly = _parse_interface(iface, type(value).__name__)
    if for_writing and readonly:
        raise InvalidValue(f"out ({type(value).__name__}) is read-only: its __cuda_array_interface__ says so")
    nbytes = math.prod(shape) * dtype.itemsize
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


def _parse_interface(iface: Any, kind: str) -> tuple[tuple[int, ...], np.dtype[Any], int, bool]:
    """(shape, dtype, data pointer, read-only flag) of a C-contiguous array's ``__cuda_array_interface__``, each
    field checked: it is the producer's word, and a malformed one must be an InvalidValue naming
    the field, not an error from deep inside this module (or a dtype guessed from a None)."""
    where = f"{kind}.__cuda_array_interface__"
    if not isinstance(iface, dict):
        raise InvalidValue(f"{where} must be a dict, got {type(iface).__name__}")
    if iface.get("mask") is not None:
        raise InvalidValue("masked device arrays are not storable")
    try:
        shape = tuple(operator.index(d) for d in iface["shape"])
    except (KeyError, TypeError) as exc:
        raise InvalidValue(f"{where} has no valid 'shape' (a tuple of ints): {exc}") from None
    if any(d < 0 for d in shape):
        raise InvalidValue(f"{where} has a negative dimension in shape {shape}")
    if len(shape) > MAX_DIMS:
        raise InvalidValue(f"device array has {len(shape)} dimensions; the limit is {MAX_DIMS}")
    typestr = iface.get("typestr")
    if not isinstance(typestr, str):
        raise InvalidValue(f"{where} has no valid 'typestr' (a string such as '<f2'), got {typestr!r:.40}")
    try:
        dtype = np.dtype(typestr)
    except TypeError:
        raise InvalidValue(f"device array of typestr {typestr!r} is not storable") from None
    # Python ints: numpy's int64 product wrapped past 2**63 elements, to 0 (an "empty" array) or
    # a negative size.
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_DEVICE_BYTES:
        raise InvalidValue(
            f"device array of shape {shape} would be {nbytes} B; no device holds over {MAX_DEVICE_BYTES} B"
        )
    strides = iface.get("strides")
    if strides is not None and nbytes:
        step = dtype.itemsize
        try:
            pairs = list(zip(reversed(shape), reversed(tuple(strides)), strict=True))
        except (TypeError, ValueError) as exc:
            raise InvalidValue(
                f"{where} has 'strides' {strides!r:.60} that do not match shape {shape}: {exc}"
            ) from None
        for dim, stride in pairs:
            if dim != 1 and stride != step:  # the stride of a length-1 axis is never used
                raise InvalidValue(f"device array of shape {shape} is not C-contiguous; pass a contiguous copy")
            step *= dim
    stream = iface.get("stream")
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
        raise InvalidValue(f"{where} has a 'stream' that is no stream handle (an int), got {stream!r:.40}")
    if stream is not None and not -(1 << 63) <= stream < 1 << 63:  # an intptr_t, as a pointer is
        raise InvalidValue(f"{where} has a 'stream' of {stream}, no stream handle (-2**63..2**63-1)")
    data = iface.get("data")
    if not nbytes:
        return shape, dtype, 0, False  # nothing is read or written through an empty array
    try:
        pointer = operator.index(data[0])  # type: ignore[index]
        readonly = data[1]  # type: ignore[index]
    except (TypeError, IndexError, KeyError) as exc:
        raise InvalidValue(f"{where} has no valid 'data' (pointer, read-only flag), got {data!r:.60}: {exc}") from None
    # cupy's runtime calls take a signed intptr_t: from 2**63 up they raised OverflowError, past
    # the CUDA error this module turns into a TransferError (the check said 2**64 until 2026-12-07)
    if not 0 < pointer < 1 << 63:
        raise InvalidValue(f"{where} names data at {pointer}, no device address (1..2**63-1)")
    return shape, dtype, pointer, bool(readonly)


def not_contiguous(tensor: Any, *, for_writing: bool) -> InvalidValue:
    """The refusal of a torch tensor (CPU or CUDA) that is not contiguous. As a destination,
    ``.contiguous()`` is no advice: it returns a copy, which get_into would fill while the tensor
    stayed as it was."""
    shape = tuple(tensor.shape)
    if for_writing:
        return InvalidValue(
            f"out (torch tensor of shape {shape}) is not contiguous: get_into fills memory in place, and "
            ".contiguous() would be a copy filled instead of it; pass a contiguous tensor (torch.empty) "
            "and copy from it into the view"
        )
    return InvalidValue(f"torch tensor of shape {shape} is not contiguous; call .contiguous()")


def lazy_view(tensor: Any) -> InvalidValue:
    """The refusal of a torch tensor that is a lazy conjugate or negative view, a CPU or a CUDA one:
    its memory holds the values before the conjugation or negation, which a copy of the bytes
    would store (or fill) as they are. torch's own error advised resolve_conj().numpy(), a copy:
    get_into would fill that, not the tensor."""
    bit, resolve = ("conjugate", "resolve_conj") if tensor.is_conj() else ("negative", "resolve_neg")
    return InvalidValue(
        f"torch tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} is a lazy {bit} view: its "
        f"memory holds other numbers than it shows; store tensor.{resolve}(), and get_into a tensor "
        "without that bit"
    )


def _describe_torch(tensor: Any, *, for_writing: bool) -> DeviceBuffer:
    """As a CPU tensor is checked (client/buffers.py): the raw bytes at data_ptr() are what is
    stored or filled, so a tensor whose values are not those bytes, or whose writes autograd must
    see, is refused rather than copied as if it were plain memory."""
    import torch  # the caller handed us a tensor, so torch is there

    if not tensor.is_cuda:
        raise InvalidValue(f"torch tensor on {tensor.device} is not a device array")
    if tensor.layout != torch.strided:  # sparse layouts have no flat buffer (is_contiguous raises)
        raise InvalidValue(f"torch tensor of layout {tensor.layout} has no flat buffer; call .to_dense() first")
    if tensor.is_conj() or tensor.is_neg():
        raise lazy_view(tensor)
    if for_writing and tensor.requires_grad:
        raise InvalidValue(
            f"out is a torch tensor that requires grad (shape {tuple(tensor.shape)}): get_into writes its "
            "memory outside autograd; pass out.detach() (the same memory) if that is what you mean"
        )
    if not tensor.is_contiguous():
        raise not_contiguous(tensor, for_writing=for_writing)
    if tensor.dim() > MAX_DIMS:
        raise InvalidValue(f"torch tensor has {tensor.dim()} dimensions; the limit is {MAX_DIMS}")
    if tensor.dtype == torch.bfloat16:
        dtype = BFLOAT16
    else:
        try:
            dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype.str
        except TypeError:
            raise InvalidValue(f"torch dtype {tensor.dtype} is not storable") from None
    device_id = int(tensor.get_device())
    try:
        # The tensor's pending writes land before its bytes are read on another stream.
        torch.cuda.current_stream(device_id).synchronize()
    except RuntimeError as exc:  # a fault left on the device by earlier work, or no context there
        raise TransferError(f"torch tensor on cuda:{device_id}: waiting for its stream failed: {exc}") from None
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
            try:
                runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, MEMCPY_DEFAULT, STREAM_LEGACY)
            finally:
                # Waited for even when an exception (a KeyboardInterrupt) lands right after the
                # copy was issued: callers free, unpin or unmap what it touches once this returns.
                runtime.streamSynchronize(STREAM_LEGACY)
    except cuda_error as exc:
        raise TransferError(f"CUDA copy of {nbytes} B (0x{src_ptr:x} -> 0x{dst_ptr:x}) failed: {exc}") from None


class PinnedHost:
    """A host range page-locked for CUDA (``cudaHostRegister``), so that copies between it and a
    device run by DMA at the bus's speed: from pageable memory the driver stages every copy through
    a bounce buffer of its own (an H200 moved 7-12 GB/s host to device that way).

    Registered while ``device_id`` is current (the device its copies go to: pinning on another would
    create a CUDA context there), and portable, so every context of the process sees it. Whoever
    owns the range unregisters it (:meth:`close`) before unmapping it and once no copy through it
    runs (:class:`mooncake_store.tiers.host._Mapping` counts them): a later mapping at the same
    address must not inherit the registration."""

    def __init__(self, pointer: int, nbytes: int, device_id: int | None = None) -> None:
        try:
            with _on_device(device_id) as cupy:
                cupy.cuda.runtime.hostRegister(pointer, nbytes, HOST_REGISTER_PORTABLE)
        except _cuda_error() as exc:  # e.g. a sandbox that refuses to lock pages
            raise GpuUnavailable(f"cannot pin {nbytes} B of host memory at 0x{pointer:x} for CUDA: {exc}") from None
        self.pointer = pointer
        self.nbytes = nbytes
        self.device_id = device_id
        self._registered = True

    @property
    def registered(self) -> bool:
        return self._registered

    def close(self) -> None:
        """Unregister. Called once, by the owner's ``weakref.finalize`` (which runs its function at
        most once, from close() or from collection). A failure is logged: it means CUDA's context is
        gone (the process is exiting; the registration went with it) or CUDA itself failed, and
        either way the caller unmaps next."""
        self._registered = False
        try:
            with _on_device(self.device_id) as cupy:
                cupy.cuda.runtime.hostUnregister(self.pointer)
        except Exception as exc:
            log.warning("unpinning %d B at 0x%x failed: %s", self.nbytes, self.pointer, exc)


def empty_device_array(nbytes: int, device: str | int) -> Any:
    """A uint8 cupy array of ``nbytes`` on ``device`` ("cuda:N" or N)."""
    device_id = parse_device(device)
    cupy = require_device(device_id)
    try:
        # Making the device current creates its context, which fails on a GPU held in exclusive
        # mode by another process or with no memory left for one.
        with cupy.cuda.Device(device_id):
            return cupy.empty(nbytes, dtype=cupy.uint8)
    except MemoryError as exc:  # cupy.cuda.memory.OutOfMemoryError
        raise NoCapacity(f"need {nbytes} B on GPU {device_id} for the result: {exc}") from None
    except _cuda_error() as exc:
        raise GpuUnavailable(f"CUDA device {device_id} is not usable: {exc}") from None


def parse_device(device: str | int) -> int:
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    if device == "cuda":
        return 0
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isascii() and device[5:].isdigit():
        return int(device[5:])
    raise InvalidValue(f"device must be 'cuda', 'cuda:N', a device index or 'cpu' (host memory), got {device!r}")
