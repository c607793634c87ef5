"""The disk inbox: reservations for chunk files that peers spill onto this agent's disk tier, on a
real directory."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from mooncake_store.agent import inbox as inbox_module
from mooncake_store.agent.inbox import DiskInbox
from mooncake_store.errors import NoCapacity
from mooncake_store.tiers.disk import DiskTier


@pytest.fixture
def blob(tmp_path: Path) -> bytes:
    """A real chunk file of about 200 KB (random bytes do not compress)."""
    source = DiskTier(tmp_path / "peer", 8 << 20)
    source.write(1, memoryview(np.random.default_rng(5).integers(0, 256, 200_000, dtype=np.uint8)))
    return source.read_blob(1)


def make_inbox(tmp_path: Path, capacity: int = 1 << 20) -> DiskInbox:
    return DiskInbox(DiskTier(tmp_path / "mine", capacity), reserve_timeout_s=5.0, ids=itertools.count(100))


def room_of(tmp_path: Path, blob: bytes) -> int:
    """What ``blob`` takes as a file of the inbox's disk: whole blocks of its filesystem."""
    return DiskTier.block_size_of(tmp_path) * -(-len(blob) // DiskTier.block_size_of(tmp_path))


def test_reservations_count_against_the_disks_free_room(tmp_path: Path, blob: bytes) -> None:
    room = room_of(tmp_path, blob)
    inbox = make_inbox(tmp_path, capacity=3 * room)
    first = inbox.reserve([(len(blob), b"a" * 16), (len(blob), b"b" * 16)])
    assert first is not None and len(first) == 2
    assert inbox.reserve([(room + 1, b"c" * 16)]) is None  # one block more than is left
    (third,) = inbox.reserve([(len(blob), b"c" * 16)]) or []
    staging = inbox.staging(third.alloc_id, third.offset, third.length)
    assert staging is not None
    staging[:] = blob
    assert inbox.written(third.alloc_id, staging)
    # The file now counts on the disk and its reservation still in the inbox: no room for more.
    assert inbox.reserve([(1, b"d" * 16)]) is None


def test_a_chunk_file_comes_whole_once_and_is_verified(tmp_path: Path, blob: bytes) -> None:
    inbox = make_inbox(tmp_path)
    (res,) = inbox.reserve([(len(blob), b"p" * 16)]) or []
    assert inbox.staging(res.alloc_id, res.offset, res.length - 1) is None  # never in pieces
    assert inbox.staging(res.alloc_id + 1, res.offset, res.length) is None  # not a reservation
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0xFF
    staging = inbox.staging(res.alloc_id, res.offset, res.length)
    assert staging is not None
    staging[:] = damaged
    assert not inbox.written(res.alloc_id, staging)  # refused: the sender keeps its copy
    assert res.alloc_id not in inbox.disk
    staging = inbox.staging(res.alloc_id, res.offset, res.length)
    assert staging is not None
    staging[:] = blob
    assert inbox.written(res.alloc_id, staging)
    again = inbox.staging(res.alloc_id, res.offset, res.length)
    assert again is not None
    again[:] = bytes(len(blob))
    assert not inbox.written(res.alloc_id, again)  # a stored file is never rewritten
    assert inbox.disk.read_blob(res.alloc_id) == blob
    assert inbox.settle([res.alloc_id, 12345]) == [res.alloc_id]
    assert res.alloc_id not in inbox and res.alloc_id in inbox.disk  # an ordinary disk file now


def test_a_free_while_the_file_arrives_voids_it(tmp_path: Path, blob: bytes) -> None:
    inbox = make_inbox(tmp_path)
    (res,) = inbox.reserve([(len(blob), b"p" * 16)]) or []
    staging = inbox.staging(res.alloc_id, res.offset, res.length)
    assert staging is not None
    inbox.free([res.alloc_id])  # the reservation timed out while the bytes were on the wire
    staging[:] = blob
    assert not inbox.written(res.alloc_id, staging)
    assert res.alloc_id not in inbox and res.alloc_id not in inbox.disk
    assert inbox.disk.used_bytes == 0 and not list((tmp_path / "mine").rglob("*.mcz"))


def test_a_broken_transfer_stores_nothing(tmp_path: Path, blob: bytes) -> None:
    inbox = make_inbox(tmp_path)
    (res,) = inbox.reserve([(len(blob), b"p" * 16)]) or []
    assert inbox.staging(res.alloc_id, res.offset, res.length) is not None
    assert not inbox.written(res.alloc_id, None)
    assert res.alloc_id in inbox and res.alloc_id not in inbox.disk
    inbox.free([res.alloc_id])
    assert len(inbox.table) == 0


def test_free_bytes_counts_files_on_the_wire_once(tmp_path: Path, blob: bytes) -> None:
    """What a demotion may still use: the disk's free room less the reserved files not yet landed."""
    room = room_of(tmp_path, blob)
    inbox = make_inbox(tmp_path, capacity=4 * room)
    assert inbox.disk.free_bytes == 4 * room
    (res,) = inbox.reserve([(len(blob), b"p" * 16)]) or []
    assert inbox.disk.free_bytes == 3 * room  # on the wire: promised to the peer
    staging = inbox.staging(res.alloc_id, res.offset, res.length)
    assert staging is not None
    staging[:] = blob
    assert inbox.written(res.alloc_id, staging)
    assert inbox.disk.free_bytes == 3 * room  # landed: counted by the disk, not twice
    assert inbox.disk.promised_bytes == 0
    inbox.settle([res.alloc_id])
    assert inbox.disk.free_bytes == 3 * room


def test_a_demotion_cannot_take_the_room_promised_to_a_peers_file(tmp_path: Path, blob: bytes) -> None:
    """A file of this agent's own (a demotion) written while a peer's file is on the wire fits
    only in what the promise leaves: taking the promised room made the peer's WRITE fail, and the
    free room negative (a RESERVE's refusal could then not be packed, and the connection closed)."""
    room = room_of(tmp_path, blob)
    inbox = make_inbox(tmp_path, capacity=2 * room)
    (res,) = inbox.reserve([(len(blob), b"p" * 16)]) or []
    own = np.random.default_rng(9).integers(0, 256, 200_000, dtype=np.uint8)
    inbox.disk.write(1, memoryview(own))  # fits in the room left
    with pytest.raises(NoCapacity, match="need"):
        inbox.disk.write(2, memoryview(own))  # would take the peer's room
    assert inbox.disk.free_bytes == 0 and inbox.room(ceiling_bytes=2 * room) == 0
    staging = inbox.staging(res.alloc_id, res.offset, res.length)
    assert staging is not None
    staging[:] = blob
    assert inbox.written(res.alloc_id, staging)  # the peer's file lands in the room held for it
    assert inbox.disk.used_bytes == 2 * room and inbox.disk.free_bytes == 0


def test_free_room_follows_each_reservation_through_its_life(tmp_path: Path, blob: bytes) -> None:
    """Room promised to files on the wire is held from the reservation until the file lands (then
    the file counts in the disk's use) or the reservation goes; a file that fails its check is
    still promised until its reservation goes."""
    inbox = make_inbox(tmp_path, capacity=8 * len(blob))
    size = room_of(tmp_path, blob)
    capacity = inbox.disk.capacity_bytes
    a, b, c = inbox.reserve([(len(blob), b"a" * 16), (len(blob), b"b" * 16), (len(blob), b"c" * 16)]) or []
    assert (inbox.disk.free_bytes, inbox.disk.promised_bytes) == (capacity - 3 * size, 3 * size)

    def land(res, data: bytes) -> bool:  # type: ignore[no-untyped-def]
        staging = inbox.staging(res.alloc_id, res.offset, res.length)
        assert staging is not None
        staging[:] = data
        return inbox.written(res.alloc_id, staging)

    assert land(a, blob)
    assert inbox.disk.used_bytes == size  # the file is on the disk now, its promise kept
    assert (inbox.disk.free_bytes, inbox.disk.promised_bytes) == (capacity - 3 * size, 2 * size)
    assert inbox.settle([a.alloc_id]) == [a.alloc_id]  # its swap was acked: a disk allocation now
    assert (inbox.disk.free_bytes, inbox.disk.promised_bytes) == (capacity - 3 * size, 2 * size)
    damaged = bytearray(blob)
    damaged[0] ^= 0xFF
    assert not land(b, bytes(damaged))
    assert (inbox.disk.free_bytes, inbox.disk.promised_bytes) == (capacity - 3 * size, 2 * size)
    inbox.free([b.alloc_id, c.alloc_id])
    inbox.free([b.alloc_id])  # again: nothing more
    inbox.settle([a.alloc_id, c.alloc_id])
    assert (inbox.disk.free_bytes, inbox.disk.promised_bytes) == (capacity - size, 0)
    assert a.alloc_id in inbox.disk and b.alloc_id not in inbox.disk


def test_room_under_a_ceiling_counts_files_on_the_wire(tmp_path: Path, blob: bytes) -> None:
    room = room_of(tmp_path, blob)
    inbox = make_inbox(tmp_path, capacity=4 * room)
    assert inbox.room(ceiling_bytes=4 * room) == 4 * room
    assert inbox.reserve([(len(blob), b"a" * 16)]) is not None  # on the wire: not yet on the disk
    assert inbox.room(ceiling_bytes=3 * room) == 2 * room
    assert inbox.room(ceiling_bytes=room) == 0
    assert inbox.reserve([(len(blob), b"b" * 16)] * 2, ceiling_bytes=3 * room) is not None  # what it said
    assert inbox.room(ceiling_bytes=3 * room) == 0
    assert inbox.reserve([(len(blob), b"c" * 16)], ceiling_bytes=3 * room) is None


def test_a_file_admitted_alone_is_taken_whatever_arrived_since(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One file is always taken, the bound said; but the check of its plain bytes, once the whole
    file was in, refused it when smaller files had been admitted meanwhile: a large file refused
    after its transfer, and again at every retry while other peers spilled."""
    monkeypatch.setattr(inbox_module, "STAGING_BYTES", 1 << 20)
    source = DiskTier(tmp_path / "peer", 16 << 20)
    rng = np.random.default_rng(9)
    source.write(1, memoryview(rng.integers(0, 256, 3 << 20, dtype=np.uint8)))  # does not compress
    source.write(2, memoryview(rng.integers(0, 256, 100_000, dtype=np.uint8)))
    big, small = source.read_blob(1), source.read_blob(2)
    disk = DiskTier(tmp_path / "mine", 64 << 20, max_blob_raw_bytes=4 << 20)
    inbox = DiskInbox(disk, reserve_timeout_s=5.0, ids=itertools.count(100))
    first, second = inbox.reserve([(len(big), b"a" * 16), (len(small), b"b" * 16)]) or []
    big_buffer = inbox.staging(first.alloc_id, first.offset, first.length)
    small_buffer = inbox.staging(second.alloc_id, second.offset, second.length)
    assert big_buffer is not None and small_buffer is not None  # both admitted by their lengths
    big_buffer[:] = big
    small_buffer[:] = small
    assert inbox.written(first.alloc_id, big_buffer), "the file admitted alone was refused once it had arrived"
    assert inbox.written(second.alloc_id, small_buffer)
    assert not inbox._staged and not inbox._alone
    source.close()
    disk.close()
