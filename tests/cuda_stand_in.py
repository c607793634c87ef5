"""A stand-in for the CUDA runtime under ``cupy``, for tests on machines without a GPU.

Only the runtime is replaced: "device memory" is host memory described by a
``__cuda_array_interface__`` and copies are memmoves. Everything above it (gpu_arrays,
client/device.py, the client's puts and gets) is the real code. The real runtime is exercised by
tests/gpu on a CUDA device."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from mooncake_store.tiers import gpu_arrays


class CUDARuntimeError(RuntimeError):
    pass


class HostRuntime:
    """One device, whose memory is this process's: attributes say device 0, copies are memmoves."""

    CUDARuntimeError = CUDARuntimeError

    def getDeviceCount(self) -> int:
        return 1

    def getDevice(self) -> int:
        return 0

    def pointerGetAttributes(self, pointer: int) -> Any:
        return types.SimpleNamespace(device=0, type=2)

    def streamSynchronize(self, stream: int) -> None:
        pass

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)


class _Device:
    def __init__(self, device_id: int) -> None:
        self.id = device_id

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@contextlib.contextmanager
def stand_in_cupy(runtime: Any) -> Iterator[Any]:
    """``import cupy`` gives a module whose ``cuda.runtime`` is ``runtime``, for the block's length."""
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=runtime, Device=_Device)  # type: ignore[attr-defined]
    saved = sys.modules.get("cupy")
    sys.modules["cupy"] = fake
    gpu_arrays._cupy.cache_clear()
    gpu_arrays._usable.clear()
    try:
        yield runtime
    finally:
        if saved is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved
        gpu_arrays._cupy.cache_clear()
        gpu_arrays._usable.clear()


class HostBackedDeviceArray:
    """A "device array" whose memory is a numpy buffer, described by its interface alone."""

    def __init__(self, backing: np.ndarray, shape: tuple[int, ...], typestr: str = "|u1") -> None:
        self._backing = backing
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (int(backing.ctypes.data), False),
            "strides": None,
            "version": 3,
        }


class CudaTensorStandIn(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device: for the checks made before any CUDA call."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


CudaTensorStandIn.__module__ = "torch.cuda_stand_in"  # is_torch_tensor looks at the module
