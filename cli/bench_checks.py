"""Checks of what a timed loop of reads wrote, shared by `mooncake bench` and benchmarks/.

A read that copies nothing after its warm-up (or copies another key's bytes) must not pass as a
fast one: each check reads again, into a destination zeroed first, after the timed loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class ReadCheckFailed(RuntimeError):
    """A benchmark's read, re-done after its timed loop, gave other bytes than were put."""


def stamp(buf: np.ndarray, i: int) -> None:
    """Key ``i``'s bytes: the case's shared source with ``i`` in its first 8 bytes, so that a read
    of another key's bytes, or one that wrote nothing over the warm-up's, is caught (check_reads)."""
    buf[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)


def check_reads(read: Callable[[int], Any], src: np.ndarray, dst: np.ndarray, count: int, what: str) -> None:
    """After a timed loop of reads: each of its ``count`` keys read once more, by ``read(i)`` into
    ``dst`` zeroed first, against its own stamp. A check of the loop's last read alone passed a
    get that copied nothing after the warm-up (every key held the same bytes)."""
    for i in range(count):
        dst[:] = 0
        read(i)
        stamp(src, i)
        if not np.array_equal(src, dst):
            raise ReadCheckFailed(f"{what}: key {i} read back wrong bytes")


def check_batch_reads(
    read: Callable[[], Any], expected: Sequence[np.ndarray], outs: Sequence[np.ndarray], what: str
) -> None:
    """A batch read (or a latency loop's one key: a batch of one) once more, into ``outs`` zeroed
    first: the timed loop's own outs were filled by its warm-up, so a read that wrote nothing after
    it passed."""
    for out in outs:
        out[:] = 0
    read()
    if not all(np.array_equal(e, o) for e, o in zip(expected, outs, strict=True)):
        raise ReadCheckFailed(f"{what}: read back wrong bytes")
