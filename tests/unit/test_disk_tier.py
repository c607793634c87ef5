"""The disk tier on a real directory: round trips, shuffling, atomic files, corruption, capacity."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mooncake_store.errors import ConfigError, InvalidValue, MooncakeError, NoCapacity
from mooncake_store.tiers import disk as disk_module
from mooncake_store.tiers import disk_dir
from mooncake_store.tiers.chunk_format import (
    FLAG_SHUFFLED,
    HEADER,
    MAGIC,
    CorruptChunk,
    shuffle_planes,
    unshuffle_planes,
)
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.tiers.disk_dir import LOCK_NAME, sweep_abandoned_tiers


def kv_like(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 0.05).astype(np.float16)


@pytest.mark.parametrize("size", [0, 1, 3, 4096, 1 << 20])
@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_round_trip(tmp_path: Path, size: int, itemsize: int) -> None:
    tier = DiskTier(tmp_path, 64 << 20)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    tier.write(7, memoryview(data), itemsize=itemsize)
    out = bytearray(size)
    assert tier.read_into(7, memoryview(out)) == size
    assert bytes(out) == data.tobytes()


def test_shuffle_planes_inverse() -> None:
    data = np.arange(11, dtype=np.uint8)
    planes = shuffle_planes(data, 2)
    assert planes[:5].tolist() == [0, 2, 4, 6, 8] and planes[5:10].tolist() == [1, 3, 5, 7, 9]
    out = np.empty_like(data)
    unshuffle_planes(planes, 2, out)
    assert np.array_equal(out, data)


def test_shuffling_pays_on_float16_kv(tmp_path: Path) -> None:
    value = kv_like(1 << 20)
    plain = DiskTier(tmp_path / "plain", 64 << 20, shuffle="never")
    shuffled = DiskTier(tmp_path / "shuffled", 64 << 20, shuffle="auto")
    a = plain.write(1, memoryview(value.view(np.uint8)), itemsize=2)
    b = shuffled.write(1, memoryview(value.view(np.uint8)), itemsize=2)
    assert b.stored_bytes < a.stored_bytes
    out = np.empty_like(value)
    shuffled.read_into(1, memoryview(out.view(np.uint8)))
    assert np.array_equal(out, value)


def test_files_are_named_by_allocation_and_removed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write(0xABCDEF, memoryview(b"x" * 1000))
    path = tier.path_of(0xABCDEF)
    assert path.exists() and path.name == "0000000000abcdef.mcz"
    assert not list(tmp_path.rglob("*.tmp"))
    # Counted in whole blocks of the filesystem, at least what it says the file takes.
    assert tier.objects == 1 and tier.used_bytes == tier.footprint(path.stat().st_size)
    assert tier.used_bytes % tier.block_bytes == 0 and tier.used_bytes >= 512 * path.stat().st_blocks
    assert tier.remove(0xABCDEF)
    assert not path.exists() and tier.used_bytes == 0 and tier.objects == 0
    assert not tier.remove(0xABCDEF)


@pytest.mark.parametrize("damage", ["flip-body", "truncate", "garbage-header", "flip-checksum"])
def test_corruption_is_detected(tmp_path: Path, damage: str) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    data = np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.uint8)
    tier.write(5, memoryview(data))
    path = tier.path_of(5)
    blob = bytearray(path.read_bytes())
    if damage == "flip-body":
        blob[HEADER.size + len(blob) // 2 - HEADER.size // 2] ^= 0xFF
    elif damage == "truncate":
        del blob[-10:]
    elif damage == "garbage-header":
        blob[0:4] = b"NOPE"
    else:
        blob[16] ^= 0x01  # the stored checksum
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptChunk, match=str(path)):
        tier.read_into(5, memoryview(bytearray(50_000)))


def test_capacity_counts_stored_bytes_in_whole_blocks(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    noise = np.random.default_rng(2).integers(0, 256, 20_000, dtype=np.uint8)
    with pytest.raises(NoCapacity, match=r"need \d+ B on disk \(a \d+ B file in \d+ B blocks\); 10000/10000 B free"):
        tier.write(1, memoryview(noise))
    tier.write(2, memoryview(bytes(20_000)))  # zeros compress to almost nothing
    stored = tier.entry(2).stored_bytes  # type: ignore[union-attr]
    assert stored < 200 and tier.used_bytes == tier.block_bytes  # one block on the filesystem
    assert tier.compression_ratio() == 20_000 / stored  # the ratio is of the stored bytes


def test_tiny_files_cannot_take_more_of_the_filesystem_than_the_capacity(tmp_path: Path) -> None:
    """Capacity counted file lengths: 20,000 files of ~50 B fitted a 1 MiB tier and took 78 MiB of
    the filesystem. Now each file counts the blocks it takes, and the filesystem agrees."""
    capacity = 64 << 10
    tier = DiskTier(tmp_path, capacity)
    written = 0
    for alloc_id in range(1, 2001):
        try:
            tier.write(alloc_id, memoryview(bytes([alloc_id % 256]) * 64))
        except NoCapacity:
            break
        written += 1
    assert written == capacity // tier.block_bytes, f"{written} files of ~50 B fitted {capacity} B"
    on_disk = sum(512 * f.stat().st_blocks for f in tmp_path.rglob("*.mcz"))
    assert on_disk <= tier.used_bytes <= capacity
    for alloc_id in range(1, written + 1):
        assert tier.remove(alloc_id)
    assert tier.used_bytes == 0


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(InvalidValue, match="capacity must be positive"):
        DiskTier(tmp_path, 0)
    tier = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(InvalidValue, match="no disk allocation 9"):
        tier.read_into(9, memoryview(bytearray(1)))
    tier.write(3, memoryview(b"abc"))
    with pytest.raises(InvalidValue, match="already exists"):
        tier.write(3, memoryview(b"abc"))
    with pytest.raises(InvalidValue, match="destination has 2 B"):
        tier.read_into(3, memoryview(bytearray(2)))


def test_leftovers_of_an_earlier_incarnation_are_cleared(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write(1, memoryview(b"old"))
    tier.path_of(2).parent.mkdir(exist_ok=True)
    tier.path_of(2).with_suffix(".tmp").write_bytes(b"half")  # a write that never finished
    tier.close(remove_files=False)  # as a crashed agent leaves them (its lock went with it)
    DiskTier(tmp_path, 1 << 20).close()
    assert not list(tmp_path.rglob("*.mcz")) and not list(tmp_path.rglob("*.tmp"))


def test_a_directory_in_use_is_refused_and_its_files_left_alone(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write(1, memoryview(b"live"))
    with pytest.raises(ConfigError, match="in use by another agent"):  # a setting to change: exit 2
        DiskTier(tmp_path, 1 << 20)
    assert tier.path_of(1).exists()
    tier.close()
    DiskTier(tmp_path, 1 << 20).close()  # free again once the owner closed it


@pytest.mark.parametrize("size", [2, 4096, 1 << 20, 1001])
def test_fast_and_general_shuffles_agree(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    general = data[: size - size % 2].reshape(-1, 2).T.reshape(-1)
    expected = np.concatenate([general, data[size - size % 2 :]])
    planes = shuffle_planes(data, 2)
    assert np.array_equal(planes, expected)
    out = np.empty_like(data)
    unshuffle_planes(planes, 2, out)
    assert np.array_equal(out, data)


def test_a_chunk_file_moves_whole_between_tiers(tmp_path: Path) -> None:
    """A spill sends the file as stored; the receiving tier verifies it and serves it byte-exact."""
    sender, receiver = DiskTier(tmp_path / "a", 8 << 20), DiskTier(tmp_path / "b", 8 << 20)
    value = kv_like(300_000)
    stored = sender.write(3, memoryview(value.view(np.uint8)), itemsize=2)
    blob = sender.read_blob(3)
    assert len(blob) == stored.stored_bytes
    entry = receiver.write_blob(99, blob)
    assert (entry.raw_bytes, entry.stored_bytes, entry.checksum) == (value.nbytes, len(blob), stored.checksum)
    assert receiver.used_bytes == receiver.footprint(len(blob)) and receiver.raw_bytes == value.nbytes
    out = np.empty_like(value)
    receiver.read_into(99, memoryview(out.view(np.uint8)))
    assert np.array_equal(out, value)
    with pytest.raises(InvalidValue, match="no disk allocation 4"):
        sender.read_blob(4)


@pytest.mark.parametrize("damage", ["flip-body", "truncate", "garbage-header", "flip-checksum"])
def test_a_damaged_chunk_file_is_refused_and_nothing_is_stored(tmp_path: Path, damage: str) -> None:
    sender, receiver = DiskTier(tmp_path / "a", 8 << 20), DiskTier(tmp_path / "b", 8 << 20)
    sender.write(3, memoryview(np.random.default_rng(2).integers(0, 256, 70_000, dtype=np.uint8)))
    blob = bytearray(sender.read_blob(3))
    if damage == "flip-body":
        blob[len(blob) // 2] ^= 0x55
    elif damage == "truncate":
        del blob[-7:]
    elif damage == "garbage-header":
        blob[0:4] = b"JUNK"
    else:
        blob[16] ^= 0x01
    with pytest.raises(CorruptChunk, match="disk allocation 9"):
        receiver.write_blob(9, blob)
    assert receiver.objects == 0 and receiver.used_bytes == 0
    assert not list((tmp_path / "b").rglob("*.mcz"))


def test_a_frame_longer_than_its_header_says_is_corruption(tmp_path: Path) -> None:
    """The body decompresses straight into the destination: bytes beyond the declared size are an
    error, not silently dropped."""
    import xxhash
    import zstandard

    tier = DiskTier(tmp_path, 1 << 20)
    data = bytes(range(100))
    body = zstandard.ZstdCompressor().compress(data)
    forged = HEADER.pack(b"MCZ1", 0, 1, 0, 50, xxhash.xxh3_64_intdigest(data[:50]), len(body)) + body
    with pytest.raises(CorruptChunk, match="more than 50 B"):
        tier.decode_into(forged, memoryview(bytearray(100)), where="forged")
    short = HEADER.pack(b"MCZ1", 0, 1, 0, 120, 0, len(body)) + body
    with pytest.raises(CorruptChunk, match="decompressed to 100 B, header says 120 B"):
        tier.decode_into(short, memoryview(bytearray(120)), where="forged")


def test_a_second_write_of_an_id_while_the_first_is_on_its_way_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers of one id at once (a peer sending two WRITEs into one disk reservation): the
    second is refused while the first is still being written, and the file holds the first's bytes."""
    tier = DiskTier(tmp_path, 1 << 20)
    in_fsync, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        in_fsync.set()
        assert release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    first = threading.Thread(target=tier.write, args=(7, memoryview(b"first" * 100)))
    first.start()
    try:
        assert in_fsync.wait(10)
        with pytest.raises(InvalidValue, match="7 already exists"):
            tier.write(7, memoryview(b"second" * 100))
    finally:
        release.set()
        first.join(10)
    out = bytearray(500)
    tier.read_into(7, memoryview(out))
    assert bytes(out) == b"first" * 100
    assert tier.used_bytes == tier.entry(7).footprint_bytes  # type: ignore[union-attr]
    tier.close()


def claiming(raw: int) -> bytes:
    """A chunk file of a few bytes whose header and zstd frame both declare ``raw`` bytes: a frame
    header with an 8-byte content size, then one empty last block."""
    frame = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", raw) + b"\x01\x00\x00"
    return HEADER.pack(MAGIC, FLAG_SHUFFLED, 2, 0, raw, 0, len(frame)) + frame


def test_a_peer_file_declaring_more_raw_bytes_than_the_limit_is_refused_before_any_allocation(tmp_path: Path) -> None:
    """write_blob made a buffer of the declared raw size to verify a peer's file: 48 bytes claiming
    256 MiB cost 256 MiB of memory before the file was found wanting, and a few such WRITEs could
    get the agent killed. The agent passes its largest memory tier as the limit."""
    tier = DiskTier(tmp_path / "t", 8 << 20, max_blob_raw_bytes=1 << 20)
    with pytest.raises(CorruptChunk, match=r"declares 268435456 B of raw bytes, more than the 1048576 B \(1.0 MiB\)"):
        tier.write_blob(5, claiming(256 << 20))
    assert tier.objects == 0 and tier.used_bytes == 0


def test_a_peer_file_declaring_more_than_memory_can_address_is_a_corrupt_chunk(tmp_path: Path) -> None:
    """Without a limit, a declared size of 2**63 raised OverflowError (not a MooncakeError: the
    agent's connection died with a traceback instead of refusing the WRITE)."""
    tier = DiskTier(tmp_path / "t", 8 << 20)
    with pytest.raises(CorruptChunk, match=f"cannot hold {1 << 63} B"):
        tier.write_blob(6, claiming(1 << 63))
    assert tier.objects == 0 and tier.used_bytes == 0


def test_a_sweep_removes_the_directories_of_tiers_whose_owner_is_gone_and_nothing_else(tmp_path: Path) -> None:
    """An agent that crashed leaves its directory (with the default node id, host and pid, its
    successor gets another one): the next agent on the disk path removes it. A live tier's
    directory (its lock held) and a directory that is not a tier's stay."""
    live = DiskTier(tmp_path / "live", 1 << 20)
    live.write(1, memoryview(np.zeros(1000, np.uint8)))
    dead = DiskTier(tmp_path / "dead", 1 << 20)
    dead.write(2, memoryview(np.ones(1000, np.uint8)))
    dead.close(remove_files=False)  # its lock goes with its descriptor, as with a process that died
    assert list((tmp_path / "dead").rglob("*.mcz"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("not a tier's")
    removed = sweep_abandoned_tiers(tmp_path, keep=tmp_path / "mine")
    assert removed == [tmp_path / "dead"]
    assert not (tmp_path / "dead").exists()
    assert (other / "keep.txt").read_text() == "not a tier's"
    out = np.empty(1000, np.uint8)
    live.read_into(1, memoryview(out))  # the live tier's file is untouched
    assert not out.any()
    live.close()


@pytest.mark.parametrize("old_lock", [False, True], ids=["new-directory", "after-a-crash"])
def test_a_tier_starting_beside_another_agents_start_sweep_keeps_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old_lock: bool
) -> None:
    """Two agents on one disk path starting at once: a tier created its lock file and locked it
    after, and the other agent's sweep of abandoned tiers, landing in between, found the lock free
    and removed the new tier's directory; that tier then failed every write and evicted its
    victims. The sweep runs here just before each lock is taken (flock, as the kernel would
    interleave two processes): whether the lock file is new, or left by a crashed incarnation
    (then the sweep takes it, and the tier claims its directory afresh)."""
    root = tmp_path / "starting"
    if old_lock:
        DiskTier(root, 1 << 20).close(remove_files=False)  # a lock file nobody holds
    real_flock = fcntl.flock
    sweeps: list[list[Path]] = []

    def flock_after_a_sweep(fd: int, operation: int) -> None:
        if not sweeps and operation & fcntl.LOCK_EX:
            sweeps.append([])  # before the sweep, which takes locks too
            sweeps[0] = sweep_abandoned_tiers(tmp_path, keep=tmp_path / "the-sweepers-own")
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_sweep)
    tier = DiskTier(root, 1 << 20)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert sweeps == ([[root]] if old_lock else [[]])
    tier.write(1, memoryview(np.ones(1000, np.uint8)))  # its directory is there
    assert sweep_abandoned_tiers(tmp_path, keep=tmp_path / "the-sweepers-own") == []  # and its lock held
    out = np.empty(1000, np.uint8)
    tier.read_into(1, memoryview(out))
    assert out.all()
    tier.close()


def test_a_sweep_that_finds_its_lock_file_replaced_leaves_the_directory_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sweeps of one crashed tier's directory: the first removed it while the second held
    its lock file open, a restarted tier claimed the directory afresh, and the second then locked
    the old, unlinked file and removed the live tier's lock, files and directory."""
    root = tmp_path / "agent-0"
    DiskTier(root, 1 << 20).close(remove_files=False)  # a crashed incarnation: its lock is free
    real_flock = fcntl.flock
    restarted: list[DiskTier] = []

    def first_sweep_and_restart_in_between(fd: int, operation: int) -> None:
        if not restarted:
            monkeypatch.setattr(fcntl, "flock", real_flock)
            assert sweep_abandoned_tiers(tmp_path, keep=tmp_path / "agent-1") == [root]
            restarted.append(DiskTier(root, 1 << 20))
            restarted[0].write(1, memoryview(np.ones(1000, np.uint8)))
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", first_sweep_and_restart_in_between)
    assert sweep_abandoned_tiers(tmp_path, keep=tmp_path / "agent-2") == []
    (tier,) = restarted
    assert tier.path_of(1).exists()
    tier.write(2, memoryview(np.ones(1000, np.uint8)))  # its directory is still there
    with pytest.raises(MooncakeError, match="in use by another agent"):
        DiskTier(root, 1 << 20)  # and its lock still held
    tier.close()


def test_a_claim_whose_directory_a_sweep_removed_meanwhile_claims_it_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep that took the free lock of a crashed incarnation just before finished removing the
    directory while the new tier opened its lock: the start failed with "cannot create the disk
    tier's lock file". It looks again (and makes the directory anew)."""
    root = tmp_path / "agent-0"
    DiskTier(root, 1 << 20).close(remove_files=False)
    real_open = os.open
    lock = str(root / LOCK_NAME)
    swept: list[list[Path]] = []

    def sweep_finishes_first(path: object, flags: int, *args: int) -> int:
        if not swept and str(path) == lock and not flags & os.O_CREAT:
            swept.append([])  # before the sweep, which opens the lock file too
            swept[0] = sweep_abandoned_tiers(tmp_path, keep=tmp_path / "agent-1")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", sweep_finishes_first)
    tier = DiskTier(root, 1 << 20)
    monkeypatch.setattr(os, "open", real_open)
    assert swept == [[root]]
    tier.write(1, memoryview(np.ones(1000, np.uint8)))
    tier.close()


@contextlib.contextmanager
def a_held_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[list[Path]]]]:
    """A crashed incarnation's directory ``tmp_path/agent-0`` (its lock free), and another agent's
    start sweep of it in a thread, held in the removal until the yielded event is set; the sweep's
    result lands in the yielded list. The sweep is released and joined at the end."""
    DiskTier(tmp_path / "agent-0", 1 << 20).close(remove_files=False)
    real_remove = disk_dir.remove_tier_dir
    sweeping, finish = threading.Event(), threading.Event()

    def held_removal(path: Path) -> bool:
        sweeping.set()
        assert finish.wait(10)
        return real_remove(path)

    monkeypatch.setattr(disk_dir, "remove_tier_dir", held_removal)
    swept: list[list[Path]] = []
    sweep = threading.Thread(target=lambda: swept.append(sweep_abandoned_tiers(tmp_path, keep=tmp_path / "agent-1")))
    sweep.start()
    try:
        assert sweeping.wait(10)
        yield finish, swept
    finally:
        finish.set()
        sweep.join(timeout=10)


def test_a_claim_while_a_sweep_removes_the_directory_waits_for_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two agents on one disk path restarting together (a host's OOM kill): each sweeps the
    other's directory before it claims its own. A claim whose lock a sweep held (removing a large
    crashed tier's files takes seconds) was refused at once as "in use by another agent"; it now
    waits for the sweep and claims the directory afresh. The sweep is held here until the claim
    has been waiting for 0.3 s."""
    root = tmp_path / "agent-0"
    with a_held_sweep(tmp_path, monkeypatch) as (finish, swept):
        threading.Timer(0.3, finish.set).start()
        tier = DiskTier(root, 1 << 20)
    assert swept == [[root]]
    tier.write(1, memoryview(np.ones(1000, np.uint8)))  # its directory is there, made afresh
    with pytest.raises(MooncakeError, match="in use by another agent"):
        DiskTier(root, 1 << 20)  # a live tier's lock still refuses at once
    tier.close()


def test_a_claim_that_waited_out_a_sweep_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep that holds the lock past the wait is named as the reason, not another agent using the
    directory (the operator's mistake that message describes is not there)."""
    monkeypatch.setattr(disk_dir, "SWEEP_WAIT_S", 0.2)
    with (
        a_held_sweep(tmp_path, monkeypatch),
        pytest.raises(MooncakeError, match=r"start sweep has held the disk tier directory .* for 0 s"),
    ):
        DiskTier(tmp_path / "agent-0", 1 << 20)


def test_a_capacity_below_one_block_is_refused(tmp_path: Path) -> None:
    """No file fits in it: the tier would only ever evict."""
    block = DiskTier.block_size_of(tmp_path)
    with pytest.raises(ConfigError, match=f"capacity {block - 1} B is less than one {block} B block"):
        DiskTier(tmp_path / "small", block - 1)
    assert not (tmp_path / "small").exists()
    DiskTier(tmp_path / "one", block).close()


def test_closing_a_tier_with_its_files_removes_its_directory(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "node", 1 << 20)
    tier.write(1, memoryview(np.zeros(1000, np.uint8)))
    tier.close()
    assert not (tmp_path / "node").exists()
    kept = DiskTier(tmp_path / "kept", 1 << 20)
    kept.write(1, memoryview(np.zeros(1000, np.uint8)))
    kept.close(remove_files=False)
    assert len(list((tmp_path / "kept").rglob("*.mcz"))) == 1


def test_a_write_that_fails_gives_its_room_back_even_when_its_temp_file_cannot_be_removed(tmp_path: Path) -> None:
    """A filesystem gone read-only (ext4's errors=remount-ro) refuses the temp file and its removal
    alike: the removal's OSError escaped, not a MooncakeError (it ended every pressure pass that
    tried to demote), and the room claimed for the file and the id being written stayed claimed
    for good. Here a directory stands where the temp file goes: opening it and unlinking it fail."""
    tier = DiskTier(tmp_path / "t", 1 << 20)
    tmp = tier.path_of(7).with_suffix(".tmp")
    tmp.mkdir(parents=True)
    with pytest.raises(MooncakeError, match="cannot write"):
        tier.write(7, memoryview(np.zeros(1000, np.uint8)))
    assert tier.used_bytes == 0 and tier.objects == 0
    tmp.rmdir()
    tier.write(7, memoryview(np.zeros(1000, np.uint8)))  # the id is not left "being written"
    assert tier.objects == 1
    tier.close()


def test_a_tier_whose_write_failed_offers_no_room_for_a_while(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its room was its capacity whatever the filesystem could take: a disk full of other data
    (ENOSPC), gone read-only or failing was still offered to peers' spills, which it refused file
    by file at their WRITEs, pass after pass. After a failed write it offers none (room(), what a
    promise grants and a demotion is planned into) for WRITE_FAILURE_HOLD_S; its accounting is
    untouched, and a write asked for anyway is still tried."""
    monkeypatch.setattr(disk_module, "WRITE_FAILURE_HOLD_S", 0.5)
    tier = DiskTier(tmp_path / "t", 1 << 20)
    tmp = tier.path_of(7).with_suffix(".tmp")
    tmp.mkdir(parents=True)
    with pytest.raises(MooncakeError, match="cannot write"):
        tier.write(7, memoryview(np.zeros(1000, np.uint8)))
    assert tier.failing and tier.room() == 0 and tier.room(ceiling_bytes=1 << 20) == 0
    assert not tier.promise({9: tier.block_bytes})
    assert tier.free_bytes == tier.capacity_bytes and tier.used_bytes == 0
    tmp.rmdir()
    tier.write(8, memoryview(np.zeros(1000, np.uint8)))
    deadline = time.monotonic() + 10
    while tier.failing and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.room() == tier.free_bytes > 0 and tier.promise({9: tier.block_bytes})
    tier.close()


@pytest.mark.parametrize(
    ("name", "holds"),
    [("EMFILE", False), ("ENFILE", False), ("ENOMEM", False), ("EIO", True), ("ENOSPC", True), ("EDQUOT", True),
     ("EROFS", True)],
)  # fmt: skip
def test_only_the_filesystems_write_errors_stop_the_tier_offering_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, holds: bool
) -> None:
    """Any failed write held the room at none for WRITE_FAILURE_HOLD_S, the process's own passing
    lacks too: one EMFILE (descriptors run out under a burst of connections) kept a healthy disk
    from peers' spills and this agent's demotions for 10 s. Such a write still fails, alone; the
    filesystem's errors (full, failing, read-only) still start the hold. The error is met where
    the temp file is opened."""
    code = getattr(errno, name)
    tier = DiskTier(tmp_path / "t", 1 << 20)
    tmp = str(tier.path_of(7).with_suffix(".tmp"))
    real_open = os.open

    def failing_open(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> int:
        if os.fspath(path) == tmp:
            raise OSError(code, os.strerror(code), tmp)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    with pytest.raises(MooncakeError, match="cannot write"):
        tier.write(7, memoryview(np.zeros(1000, np.uint8)))
    monkeypatch.undo()
    assert tier.used_bytes == 0 and tier.objects == 0
    if holds:
        assert tier.failing and tier.room() == 0
    else:
        assert not tier.failing and tier.room() == tier.free_bytes == tier.capacity_bytes
        assert tier.promise({9: tier.block_bytes})
    tier.close()


def test_a_real_emfile_at_a_write_leaves_the_room_offered(tmp_path: Path) -> None:
    """The same with a real EMFILE: the descriptor limit lowered, while a file is written, to the
    lowest free descriptor (the one the next open would take)."""
    import resource

    tier = DiskTier(tmp_path / "t", 1 << 20)
    view = memoryview(np.zeros(1000, np.uint8))
    lowest_free = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest_free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        with pytest.raises(MooncakeError, match="Too many open files"):
            tier.write(7, view)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not tier.failing and tier.room() == tier.capacity_bytes
    tier.write(7, view)  # descriptors to be had again: the same write goes through
    assert tier.objects == 1
    tier.close()


def test_a_chunk_file_swapped_for_another_sound_one_is_corrupt_not_served(tmp_path: Path) -> None:
    """Reads checked a file only against its own header (and its raw size against the entry's): a
    file replaced by another sound chunk file of the same size (a misdirected write, files copied
    between directories) decoded cleanly and was served, or spilled, as this object's bytes."""
    tier = DiskTier(tmp_path / "t", 8 << 20)
    tier.write(1, memoryview(np.full(4096, 1, np.uint8)))
    tier.write(2, memoryview(np.full(4096, 2, np.uint8)))
    tier.path_of(1).write_bytes(tier.path_of(2).read_bytes())
    out = np.zeros(4096, np.uint8)
    with pytest.raises(CorruptChunk, match="were stored"):
        tier.read_into(1, memoryview(out))
    with pytest.raises(CorruptChunk, match="were stored"):
        tier.read_blob(1)  # what a spill sends
    assert not out.any()
    tier.close()


@pytest.mark.parametrize(("flags", "reserved"), [(0xFE, 0), (0x01 | 0x80, 0), (0, 7)])
def test_a_chunk_file_with_bits_this_format_does_not_define_is_refused(
    tmp_path: Path, flags: int, reserved: int
) -> None:
    """Unknown flag bits and a nonzero reserved field were accepted: a file of a later format that
    gives them a meaning would be misread by this build rather than refused."""
    tier = DiskTier(tmp_path / "t", 8 << 20)
    blob, _ = tier.encode(memoryview(np.arange(4096, dtype=np.uint8)), itemsize=1)
    magic, _, itemsize, _, raw, checksum, clen = HEADER.unpack_from(blob)
    bad = HEADER.pack(magic, flags, itemsize, reserved, raw, checksum, clen) + blob[HEADER.size :]
    with pytest.raises(CorruptChunk, match="are not this format's"):
        tier.write_blob(1, bad)
    tier.close()


@pytest.mark.parametrize(
    ("fault", "said"),
    [
        ("magic", r"not a disk-tier chunk \(magic b'NOPE', not b'MCZ1'"),
        ("length", r"its header says \d+ B of compressed data follow, but \d+ B do"),
        ("itemsize", r"its header gives an item size of 0 B"),
    ],
)
def test_a_bad_header_is_named_for_what_is_wrong_with_it(tmp_path: Path, fault: str, said: str) -> None:
    """The three faults of a chunk file's header read as one message, "not a disk-tier chunk (magic
    b'MCZ1', ...)", though the magic was right for two of them (a peer's spilled file with an item
    size of 0, or a length field that lies, were logged so)."""
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write(5, memoryview(np.arange(4096, dtype=np.uint8)))
    magic, flags, itemsize, reserved, raw, checksum, clen = HEADER.unpack_from(tier.path_of(5).read_bytes())
    blob = bytearray(tier.path_of(5).read_bytes())
    if fault == "magic":
        magic = b"NOPE"
    elif fault == "length":
        blob += b"\0"  # a byte past what the header says follows
    else:
        itemsize = 0
    HEADER.pack_into(blob, 0, magic, flags, itemsize, reserved, raw, checksum, clen)
    with pytest.raises(CorruptChunk, match=said):
        DiskTier.parse_header(blob, where="a peer's chunk file")
