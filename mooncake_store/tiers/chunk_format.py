"""The disk tier's chunk file format: a 32 B header, then one zstd frame of the raw bytes, with
byte-plane shuffling for 2-byte dtypes (see tiers/disk.py for the layout and why). Here apart so
that an agent without a disk tier of its own can make the file a peer's disk tier takes."""

from __future__ import annotations

import struct

import numpy as np
import xxhash
import zstandard

from mooncake_store.errors import MooncakeError

HEADER = struct.Struct("<4sBBHQQQ")
MAGIC = b"MCZ1"
FLAG_SHUFFLED = 1


class CorruptChunk(MooncakeError):
    """A disk-tier file failed its checksum or is not a file of this tier."""


class ChunkUnreadable(MooncakeError):
    """A disk-tier file that is kept but cannot be read now, for a reason of the process's own (out
    of descriptors or memory, permissions changed under it): no damage, the read fails."""


def encode_chunk(
    view: memoryview, *, itemsize: int, shuffle: str = "auto", compressor: zstandard.ZstdCompressor | None = None
) -> tuple[bytes, int]:
    """(chunk file bytes, checksum) for ``view``, as a disk tier stores it. Module level so that an
    agent without a disk tier of its own can still make the file a peer's disk tier takes (a
    repair copying a host object to a peer's disk: agent/payloads.py). ``compressor``: a tier's
    own (level and thread); by default one of level 3."""
    checksum = xxhash.xxh3_64_intdigest(view)
    data = np.frombuffer(view, dtype=np.uint8)
    shuffled = (shuffle == "always" and itemsize > 1) or (shuffle == "auto" and itemsize == 2)
    payload = shuffle_planes(data, itemsize) if shuffled and len(data) else data
    body = (compressor or zstandard.ZstdCompressor(level=3)).compress(memoryview(payload))
    header = HEADER.pack(MAGIC, FLAG_SHUFFLED if shuffled else 0, itemsize, 0, len(view), checksum, len(body))
    return header + body, checksum


def file_bytes_at_most(raw_bytes: int) -> int:
    """The longest chunk file ``raw_bytes`` can make: the header and zstd's bound for one frame
    (ZSTD_COMPRESSBOUND; incompressible bytes are stored, not shrunk). What a demotion plans by,
    before it has compressed anything: a file larger than the room it was planned into would fail."""
    small_input_margin = ((128 << 10) - raw_bytes) >> 11 if raw_bytes < (128 << 10) else 0
    return HEADER.size + raw_bytes + (raw_bytes >> 8) + small_input_margin


def shuffle_planes(data: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte planes of ``data`` (uint8): all first bytes of each element, then all second bytes..."""
    whole = len(data) - len(data) % itemsize
    if itemsize == 2 and whole == len(data) and data.ctypes.data % 2 == 0:
        # Mask and shift on a uint16 view: several times faster than a strided byte transpose.
        halves = data.view(np.uint16)
        out = np.empty(len(data), dtype=np.uint8)
        np.bitwise_and(halves, 0xFF, out=out[: len(halves)], casting="unsafe")
        np.right_shift(halves, 8, out=out[len(halves) :], casting="unsafe")
        return out
    planes = data[:whole].reshape(-1, itemsize).T.reshape(-1)
    return np.concatenate([planes, data[whole:]]) if whole < len(data) else np.ascontiguousarray(planes)


def unshuffle_planes(planes: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    whole = len(out) - len(out) % itemsize
    if itemsize == 2 and whole == len(out) and out.ctypes.data % 2 == 0:
        half = len(out) // 2
        joined = out.view(np.uint16)
        np.left_shift(planes[half:], 8, out=joined, dtype=np.uint16)
        np.bitwise_or(joined, planes[:half], out=joined)
        return
    out[:whole].reshape(-1, itemsize)[:] = planes[:whole].reshape(itemsize, -1).T
    out[whole:] = planes[whole:]
