"""A chunk file is read as the regular file of the length the tier recorded, or refused as damaged
(CorruptChunk: the replica is dropped, and copied again from another where there is one). It was
read whole by path: a file grown on disk (a misdirected write appended to it, `truncate -s`) was
held at its full length, past the agents' read budget (a 1 GiB file of a 256 KiB object took
1 GiB per READ) and with a sound header passed as the object's file; a FIFO put in its place
blocked the READ's thread for good; a link was followed to whatever it named."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mooncake_store.tiers.disk import CorruptChunk, DiskTier

MiB = 1 << 20


def _grown(path: Path) -> None:
    os.truncate(path, path.stat().st_size + 64 * MiB)  # sparse: no disk, but 64 MiB to read


def _shrunk(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link(path: Path) -> None:
    """A link to a copy of the file itself: sound bytes, but not the file the tier wrote."""
    copy = path.with_name("copy")
    copy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(copy)


def _socket(path: Path) -> None:
    """A unix socket bound in its place: opening it fails with ENXIO, which was taken for the
    process's own trouble (the file kept, every read failing on it, never counted corrupt)."""
    path.unlink()
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(path))  # the socket file stays after the close


@pytest.mark.parametrize(
    "damage", [_grown, _shrunk, _fifo, _link, _socket], ids=["grown", "shrunk", "fifo", "link", "socket"]
)
def test_a_chunk_file_of_another_shape_is_damage_found_before_it_is_read(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    tier = DiskTier(tmp_path / "node", 256 * MiB)
    try:
        value = np.arange(100_000, dtype=np.uint16)
        tier.write(7, memoryview(value).cast("B"))
        path = tier.path_of(7)
        damage(path)
        outcome: list[BaseException | bytes] = []

        def read() -> None:
            try:
                outcome.append(tier.read_blob(7))
            except BaseException as exc:  # reported below
                outcome.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=30)
        if reader.is_alive():  # the FIFO's open on the old code: let it go before failing
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(timeout=10)
            pytest.fail(f"reading {path} ({damage.__name__}) blocked")
        assert len(outcome) == 1 and isinstance(outcome[0], CorruptChunk), outcome[0]
        assert str(path) in str(outcome[0])
        if damage in (_grown, _shrunk):  # told by its length, before a byte of it was read
            assert f"is {path.stat().st_size} B, but a file of" in str(outcome[0])
    finally:
        tier.close()


def test_a_sound_chunk_file_reads_back(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "node", 16 * MiB)
    try:
        value = np.arange(100_000, dtype=np.uint16)
        entry = tier.write(3, memoryview(value).cast("B"))
        blob = tier.read_blob(3)
        assert len(blob) == entry.stored_bytes == tier.path_of(3).stat().st_size
    finally:
        tier.close()
