"""GPU review (session 5), desk-checked against cupy's sources: this process's own arena used
through a segment after it was closed. Skipped without cupy and a CUDA device (tests/gpu/conftest.py);
the GPU segments' fallbacks that need no device are in tests/integration/test_gpu_segments.py."""

from __future__ import annotations

import pytest

from mooncake_store.errors import TransferError
from mooncake_store.tiers.gpu import GpuArena, GpuSegment

MiB = 1 << 20


def test_a_segment_of_this_processs_own_arena_refuses_copies_once_it_is_closed(cupy) -> None:  # type: ignore[no-untyped-def]
    """CUDA refuses to open a handle in the process that exported it, so such a segment uses the
    arena's pointer directly: after the arena is freed, a copy must fail, not land in memory that
    a later allocation of this process may own."""
    arena = GpuArena(0, MiB)
    seg = GpuSegment(0, arena.ipc_handle, MiB)
    with seg.in_use():
        pass  # open: copies go through
    arena.close()
    with pytest.raises(TransferError, match="closed"), seg.in_use():
        pass
    seg.close()
