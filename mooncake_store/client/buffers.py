"""Turning what callers hand us (bytes, memoryview, any buffer, numpy arrays, CPU torch tensors)
into byte views without copying, and stored bytes back into arrays.

dtypes travel as numpy's ``dtype.str`` (``<f2``, ``|u1``, ...), plus ``bfloat16`` for torch
tensors, which numpy cannot describe.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake_store.errors import DtypeMismatch, InvalidValue, MooncakeError, ProtocolError
from mooncake_store.tiers.gpu_arrays import is_torch_tensor, lazy_view, not_contiguous
from mooncake_store.types import MAX_DIMS

BFLOAT16 = "bfloat16"
#: numpy kinds we store: bool, signed/unsigned ints, floats, complex. Objects, strings and
#: structured dtypes have no stable byte layout across processes.
ALLOWED_KINDS = frozenset("biufc")


@dataclass(frozen=True, slots=True)
class Source:
    view: memoryview  # format "B", C-contiguous, len == nbytes
    dtype: str
    shape: tuple[int, ...]
    keepalive: Any = None  # the object whose memory view points into


def _torch_to_numpy(tensor: Any, *, for_writing: bool = False) -> tuple[np.ndarray, str]:
    import torch  # lazy: torch is optional

    if tensor.device.type != "cpu":
        raise InvalidValue(f"torch tensor on {tensor.device}; only CPU tensors are supported here")
    if tensor.layout != torch.strided:  # sparse layouts have no flat buffer (nor is_contiguous)
        raise InvalidValue(f"torch tensor of layout {tensor.layout} has no flat buffer; call .to_dense() first")
    if not tensor.is_contiguous():
        raise not_contiguous(tensor, for_writing=for_writing)
    if tensor.dim() > MAX_DIMS:
        raise InvalidValue(f"torch tensor has {tensor.dim()} dimensions; the limit is {MAX_DIMS}")
    if tensor.is_conj() or tensor.is_neg():
        raise lazy_view(tensor)
    if tensor.dtype == torch.bfloat16:
        return tensor.detach().view(torch.int16).numpy(), BFLOAT16
    try:
        array = tensor.detach().numpy()
    except ValueError as exc:  # a shape numpy cannot make: an empty (0, 2**62) escaped as numpy's
        raise InvalidValue(f"torch tensor of shape {tuple(tensor.shape)} has no numpy form ({exc})") from None
    except (TypeError, RuntimeError) as exc:  # float8, ...: no numpy layout
        raise InvalidValue(
            f"torch tensor of dtype {tensor.dtype} has no numpy form to store or fill ({exc}); "
            "supported: bool, int, uint, float16/32/64, bfloat16 and complex tensors"
        ) from None
    return array, array.dtype.str


#: Numpy types whose layout is the machine's own: long double, where it is wider than float64.
_MACHINE_LAYOUT = frozenset({np.longdouble, np.clongdouble}) if np.dtype(np.longdouble).itemsize > 8 else frozenset()


def check_dtype(dtype: np.dtype) -> str:
    if dtype.kind not in ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise InvalidValue(f"dtype {dtype} is not storable; use bool, int, uint, float or complex dtypes")
    if dtype.byteorder == ">":
        raise InvalidValue(f"dtype {dtype.str} is big-endian; convert with .astype('{dtype.newbyteorder('=').str}')")
    if dtype.type in _MACHINE_LAYOUT:
        # '<f16' is x87's 80-bit format here, IEEE quad on aarch64, double-double on ppc64le: read
        # on another machine it would be other numbers, with no error.
        raise InvalidValue(
            f"dtype {dtype} (C long double) is laid out differently on each kind of machine; "
            "store float64, or its raw bytes (.view(np.uint8))"
        )
    return dtype.str


def as_source(value: object) -> Source:
    """A read-only byte view of ``value``; raises InvalidValue for anything without a flat layout."""
    if isinstance(value, bytes | bytearray):
        return Source(memoryview(value).cast("B"), "|u1", (len(value),), value)
    if is_torch_tensor(value):
        array, dtype = _torch_to_numpy(value)
        return Source(_byte_view(array), dtype, tuple(array.shape), array)
    if isinstance(value, np.ma.MaskedArray) and np.ma.is_masked(value):
        raise InvalidValue(
            "a masked array with masked values has no single byte layout to store: pass "
            "value.filled(fill_value), or value.data for the values under the mask as they are"
        )
    if isinstance(value, np.ndarray):
        # As a base ndarray: a subclass keeps its own rules (np.matrix stays 2-D through
        # reshape(-1)), and a byte view of it counted one item where it had many bytes: the WRITE
        # announced 1 B and sent them all, its bytes read by the agent as the next frames.
        array = np.asarray(value)
    else:
        try:
            view = memoryview(value)  # type: ignore[arg-type]
            if view.format.lstrip("@=<>!") == "c" and view.c_contiguous:
                # Chars (a ctypes string buffer, memoryview.cast("c")) are raw bytes, stored as
                # such: numpy reads them as strings (|S1), which no dtype check lets through.
                return Source(view.cast("B") if view.nbytes else memoryview(b""), "|u1", (view.nbytes,), value)
            array = np.asarray(view)
        # No buffer, or a format numpy cannot read; RuntimeError: a record format whose item size
        # numpy reads otherwise (a structured scalar, a padded record array's memoryview).
        except (TypeError, ValueError, NotImplementedError, RuntimeError) as exc:
            raise InvalidValue(
                f"cannot store a value of type {type(value).__name__} ({exc}): pass bytes, a memoryview or buffer of "
                "numbers, a numpy array or a CPU torch tensor"
            ) from None
    if array.ndim > MAX_DIMS:
        raise InvalidValue(f"array has {array.ndim} dimensions; the limit is {MAX_DIMS}")
    dtype = check_dtype(array.dtype)
    if not array.flags.c_contiguous:
        raise InvalidValue(
            f"array of shape {array.shape} is not C-contiguous; pass np.ascontiguousarray(value) "
            "(the store never copies silently)"
        )
    return Source(_byte_view(array), dtype, tuple(array.shape), array)


def _byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a 1-D view of format "B": its len() is its size in
    bytes, which every transfer takes it for."""
    if array.size == 0:
        return memoryview(b"")
    view = memoryview(np.asarray(array).reshape(-1).view(np.uint8))
    assert view.ndim == 1 and len(view) == view.nbytes
    return view


#: The dtype of raw bytes (bytes, bytearray, a uint8 array): readable into, and from, any dtype.
RAW_BYTES = "|u1"


@dataclass(frozen=True, slots=True)
class Destination:
    view: memoryview  # format "B", C-contiguous, writable
    dtype: str  # numpy's dtype.str, "bfloat16", or RAW_BYTES for an untyped buffer
    tensor: Any = None  # the torch tensor filled through view, if one was given (mark_written)


def mark_written(dests: Sequence[Destination]) -> None:
    """Tell torch that the tensors among ``dests`` were written: their bytes changed behind its
    back (through a numpy view), and autograd must see it as the in-place write it was. A tensor
    saved for a backward pass and overwritten this way gave wrong gradients with no error."""
    for dest in dests:
        if dest.tensor is not None:
            bump_version(dest.tensor)


def bump_version(tensor: Any) -> None:
    """Bump a torch tensor's version counter, as an in-place write does. A tensor made under
    ``torch.inference_mode()`` has none: torch before 2.5 raised for it outside that mode (a
    get_into worker thread always is), after a read that had succeeded."""
    import torch  # the caller passed a tensor, so torch is there

    if not tensor.is_inference():
        torch.autograd.graph.increment_version(tensor)


#: The 2-byte integer types that hold bfloat16's bits where nothing names bfloat16 (numpy, cupy):
#: a bfloat16 object is read into them, and their bits into a bfloat16 tensor, as they are.
BFLOAT16_BITS = frozenset({"<i2", "<u2"})


def check_fill_dtype(key: str, stored: str, out: str) -> None:
    """A typed destination must have the stored dtype: float16 bytes read into a float32 array
    would come out as other numbers without a word. Raw bytes on either side are bytes."""
    if out == stored or RAW_BYTES in (out, stored):
        return
    if BFLOAT16 in (out, stored) and {out, stored} - {BFLOAT16} <= BFLOAT16_BITS:
        return
    raise DtypeMismatch(
        f"key {key!r} holds {stored} but out has dtype {out}: get_into copies the bytes as they are; "
        f"pass an array of {stored}, or a uint8 view of out for the raw bytes",
        stored=stored,
        out=out,
    )


def as_destination(out: object) -> Destination:
    """A writable, contiguous byte view of ``out``, and its dtype."""
    dtype = RAW_BYTES
    tensor = None
    if is_torch_tensor(out):
        if out.requires_grad:  # type: ignore[attr-defined]
            raise InvalidValue(
                f"out is a torch tensor that requires grad (shape {tuple(out.shape)}): get_into writes its "  # type: ignore[attr-defined]
                "memory outside autograd; pass out.detach() (the same memory) if that is what you mean"
            )
        tensor = out
        array, dtype = _torch_to_numpy(out, for_writing=True)
        out = array
    elif isinstance(out, np.ndarray):
        dtype = out.dtype.str
    if isinstance(out, np.ndarray) and (
        out.dtype.kind not in ALLOWED_KINDS or out.dtype.fields is not None or out.dtype.subdtype is not None
    ):
        # Raw bytes over Python object pointers (or a layout numpy will not export) is not a buffer.
        raise InvalidValue(
            f"out has dtype {out.dtype}; get_into writes raw bytes: pass a bool, int, uint, float or "
            "complex array, or a bytearray"
        )
    try:
        view = memoryview(out)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise InvalidValue(
            f"out must be a writable buffer (bytearray, numpy array, CPU torch tensor), got {type(out).__name__}: {exc}"
        ) from None
    if "O" in view.format:
        raise InvalidValue(f"out ({type(out).__name__}) holds Python objects (buffer format {view.format!r})")
    if view.readonly:
        raise InvalidValue(f"out ({type(out).__name__}) is read-only")
    if not view.c_contiguous:
        raise InvalidValue(f"out ({type(out).__name__}, shape {view.shape}) is not C-contiguous")
    if dtype == RAW_BYTES and view.format != "B" and not isinstance(out, np.ndarray):
        try:  # a typed buffer (array.array("f"), a cast memoryview) is filled as its type
            typed = np.asarray(view).dtype
        except (TypeError, ValueError, NotImplementedError, RuntimeError):
            typed = None  # a format numpy cannot name: its bytes are taken as they are
        if typed is not None and typed.kind in ALLOWED_KINDS:
            dtype = typed.str  # else chars or records (a ctypes string buffer's "<c"): raw bytes
    if view.nbytes == 0:
        return Destination(memoryview(bytearray(0)), dtype, tensor)
    # Cast unless already one byte per item: a ctypes union or packed-struct array says "B" with
    # items of several bytes, and its len() counted items, not bytes.
    flat = view if view.format == "B" and view.ndim == 1 and view.itemsize == 1 else view.cast("B")
    return Destination(flat, dtype, tensor)


def check_disjoint(dests: Sequence[Destination]) -> None:
    """Refuse a batch whose output buffers share memory: each key's bytes would land over
    another's, and only the last one read would be there, with no error."""
    spans = sorted(
        (np.frombuffer(dest.view, np.uint8).ctypes.data, len(dest.view), i)
        for i, dest in enumerate(dests)
        if len(dest.view)
    )
    for (start, size, i), (next_start, _, j) in itertools.pairwise(spans):
        if next_start < start + size:
            first, second = sorted((i, j))
            raise InvalidValue(
                f"outs[{first}] and outs[{second}] share memory ({start + size - next_start} B overlap): "
                "each key needs its own buffer, or the later read overwrites the earlier one"
            )


def to_array(buffer: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
    """View raw bytes (a uint8 array) as the stored dtype and shape; bfloat16 comes back as torch."""
    if dtype == BFLOAT16:
        try:
            import torch  # lazy
        except ImportError:
            raise InvalidValue(
                f"a bfloat16 object of shape {shape} comes back as a torch tensor, and torch is not installed: "
                "install torch, or read its bits with get_into into an int16, uint16 or uint8 buffer"
            ) from None
        return torch.from_numpy(typed_view(buffer, dtype, shape)).view(torch.bfloat16)
    return typed_view(buffer, dtype, shape)


def host_buffer(key: str, nbytes: int) -> np.ndarray:
    """A new uint8 array for ``key``'s ``nbytes``: a MooncakeError naming the size and this host's
    available memory when the process cannot have it, not numpy's bare MemoryError."""
    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError as exc:
        try:
            available = f"{os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')} B"
        except (OSError, ValueError):
            available = "an unknown amount"
        raise MooncakeError(
            f"cannot allocate {nbytes} B for key {key!r} in this process (this host has {available} of memory "
            f"available; {exc}): get_into reads it into memory of your own (a memory-mapped file, say)"
        ) from None


def typed_view(buffer: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """``buffer`` (a uint8 numpy or cupy array) viewed as ``dtype`` (bfloat16 as int16) and
    ``shape``. A ProtocolError when the index's record of them does not fit the object's bytes
    (written by hand or by another build): numpy's ValueError or TypeError escaped the SDK, and a
    dimension of -1 was filled in, giving the array another shape than the one recorded."""
    nbytes = int(buffer.size)
    try:
        typed = np.dtype(np.int16 if dtype == BFLOAT16 else dtype)
    except (TypeError, ValueError):
        typed = None
    if (
        typed is None
        or typed.kind not in ALLOWED_KINDS
        or typed.fields is not None
        or typed.subdtype is not None
        or len(shape) > MAX_DIMS
        or any(d < 0 for d in shape)
        or math.prod(shape) * typed.itemsize != nbytes
    ):
        raise ProtocolError(
            f"the index records an object of {nbytes} B as dtype {dtype!r:.40} of shape {shape!r:.80}, which do "
            f"not fit (a storable dtype, at most {MAX_DIMS} dimensions of 0 or more, as many items as the "
            "bytes hold): a malformed record, written by hand or by another build; get_into reads its bytes"
        )
    return buffer.view(typed).reshape(shape)


def itemsize_of(dtype: str) -> int:
    return 2 if dtype == BFLOAT16 else np.dtype(dtype).itemsize
