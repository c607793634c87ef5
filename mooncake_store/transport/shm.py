"""Same-host path: the client maps the agent's host arena and copies with one memcpy.

Reads take no agent CPU at all; their safety comes from the index (a read lease keeps the
allocation from being freed while it lasts, DESIGN.md §3.3). numpy's copy releases the GIL, so
concurrent gets in one process copy in parallel.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import xxhash

from mooncake_store.errors import InvalidValue, MooncakeError, TransferError
from mooncake_store.tiers.host import SHM_DIR, SharedSegment


def local_host_id() -> str:
    """Identifies this machine (and boot): two processes with equal ids can share /dev/shm."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{os.uname().nodename}/{boot_id}"


#: Piece of a copy that is hashed right after it lands: small enough to be still in cache then,
#: so the hash reads cache, not memory; large enough for the copy to keep the speed of a large
#: memcpy (pieces of 512 KiB made a 4 MiB copy 20% slower here). With 1 MiB pieces a put of a
#: cold 32 MiB value took 12% less than hashing the value and then copying it, and the same at
#: 4 MiB; copying whole and then hashing took 9% more at 32 MiB (the arena copy was out of cache).
HASH_PIECE_BYTES = 1 << 20


def copy_bytes(dest: memoryview, src: memoryview) -> None:
    np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def copy_and_hash(dest: memoryview, src: memoryview) -> int:
    """Copy ``src`` into ``dest`` and return the xxh3-64 of ``dest``: of the bytes as they landed,
    which a source changed during the copy makes differ from any hash of the source taken before
    or after it. Piece by piece, each hashed while still in cache: one pass over memory, as
    hashing the source first was."""
    out, inp = np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    if len(dest) <= HASH_PIECE_BYTES:
        np.copyto(out, inp)
        return xxhash.xxh3_64_intdigest(dest)
    state = xxhash.xxh3_64()  # its digest equals the one-shot xxh3_64 of the whole
    for start in range(0, len(dest), HASH_PIECE_BYTES):
        end = start + HASH_PIECE_BYTES
        np.copyto(out[start:end], inp[start:end])
        state.update(dest[start:end])
    return state.intdigest()


class ShmTransport:
    def __init__(self) -> None:
        self._segments: dict[str, SharedSegment] = {}
        self._lock = threading.Lock()
        #: shm name -> lock held while that one segment is mapped: MAP_POPULATE of a large arena
        #: takes ~0.1 s per GiB, which only the threads that need that arena may wait for.
        self._opening: dict[str, threading.Lock] = {}
        self._closed = False

    def reachable(self, shm_name: str) -> bool:
        """A mapped segment stays readable while mapped; only unmapped ones cost a stat()."""
        if not shm_name:
            return False
        seg = self._segments.get(shm_name)
        if seg is not None and not seg.closed:
            return True
        return (SHM_DIR / shm_name).exists()

    def mapped_any(self) -> bool:
        return bool(self._segments)

    def vanished(self) -> bool:
        """Whether the file of a mapped segment is gone from /dev/shm (its agent stopped, or a
        sweep removed a dead one's): a stat per mapped segment."""
        with self._lock:
            names = list(self._segments)
        return any(not (SHM_DIR / name).exists() for name in names)

    def mapped(self, shm_name: str) -> bool:
        seg = self._segments.get(shm_name)
        return seg is not None and not seg.closed

    def _mapped_or_opening(self, shm_name: str) -> SharedSegment | threading.Lock:
        with self._lock:
            if self._closed:  # a mapping made now would outlive close()
                raise MooncakeError(f"shm transport is closed (asked for {shm_name})")
            seg = self._segments.get(shm_name)
            if seg is not None and not seg.closed:
                return seg
            return self._opening.setdefault(shm_name, threading.Lock())

    def segment(self, shm_name: str, size_bytes: int, *, populate: bool = True) -> SharedSegment:
        found = self._mapped_or_opening(shm_name)
        if isinstance(found, SharedSegment):
            return found
        with found:  # one thread maps it; the others wait for that one arena only
            again = self._mapped_or_opening(shm_name)
            if isinstance(again, SharedSegment):
                return again
            try:
                seg = SharedSegment.attach(shm_name, size_bytes, populate=populate)
            except BaseException:
                with self._lock:
                    self._opening.pop(shm_name, None)
                raise
            with self._lock:  # listed as it stops being opened: no second thread maps it again
                self._opening.pop(shm_name, None)
                closed = self._closed
                if not closed:
                    self._segments[shm_name] = seg
            if closed:
                seg.close()
                raise MooncakeError(f"shm transport is closed (asked for {shm_name})")
            return seg

    def _view(self, shm_name: str, arena_bytes: int, offset: int, length: int) -> memoryview:
        seg = self.segment(shm_name, arena_bytes)
        try:
            return seg.view(offset, length)
        except InvalidValue as exc:
            # A location past the arena: the index record was not of its agent's making (written
            # by hand, or by another build). A transfer error, so that the read goes on to the
            # next replica as it does when the agent answers such a READ over TCP (STALE).
            raise TransferError(f"{exc}: the index names a location this agent's arena does not have") from None
        except MooncakeError as exc:
            if not seg.closed:
                raise
            # Unmapped since it was looked up (another thread's retain(): its agent left the node
            # table): the caller's fallbacks (the next replica, another node) take it from here.
            raise TransferError(f"{shm_name} was unmapped during the copy: {exc}") from None

    def read_into(self, shm_name: str, arena_bytes: int, offset: int, dest: memoryview) -> None:
        copy_bytes(dest, self._view(shm_name, arena_bytes, offset, len(dest)))

    def write_from(self, shm_name: str, arena_bytes: int, offset: int, src: memoryview) -> int:
        """Copy ``src`` into the arena at ``offset``; returns the xxh3-64 of the bytes as they
        landed there (copy_and_hash)."""
        return copy_and_hash(self._view(shm_name, arena_bytes, offset, len(src)), src)

    def retain(self, shm_names: set[str]) -> None:
        """Unmap the segments not named in ``shm_names`` (agents that left the node table): a
        mapping keeps a dead agent's whole arena in memory after its file is unlinked. A copy
        still under way keeps its pages until its view is released (SharedSegment.close)."""
        with self._lock:
            gone = [name for name in self._segments if name not in shm_names]
            dropped = [self._segments.pop(name) for name in gone]
        for seg in dropped:
            seg.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segments, self._segments = list(self._segments.values()), {}
        for seg in segments:
            seg.close()
