"""The disk tier: one zstandard-compressed file per allocation, written atomically, checksummed.

File names come from the allocation id (a number the agent issues), never from user keys, so no
key can escape the directory or collide with another. A file is::

    header (32 B): magic "MCZ1" | flags u8 | itemsize u8 | reserved u16 | raw size u64
                   | xxh3-64 of the raw bytes u64 | compressed size u64
    body: one zstd frame

``flags & 1`` marks byte-plane shuffling: for 2-byte dtypes (float16/bfloat16 KV caches) the low and
high bytes of every element are stored as two planes, which puts the slowly varying exponent bytes
next to each other and lets zstd find far more redundancy than in the interleaved layout. Reads
verify the checksum, so a corrupted file is an error, never wrong data.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from mooncake_store.config import format_size
from mooncake_store.errors import ConfigError, InvalidValue, MooncakeError, NoCapacity
from mooncake_store.tiers.chunk_format import (  # re-exported: the format's names were this module's
    FLAG_SHUFFLED,
    HEADER,
    MAGIC,
    ChunkUnreadable,
    CorruptChunk,
    encode_chunk,
    unshuffle_planes,
)
from mooncake_store.tiers.disk_dir import SUFFIX, claim_dir, clear_chunk_files, remove_tier_dir

#: Errors reading a chunk file that say the file itself is gone or unreadable, so its replica
#: is dropped (CorruptChunk); any other error is the process's, and the file is kept. ELOOP: a
#: link in its place; ENXIO, ENODEV: a socket, or a device with no driver (kept, a socket failed
#: every read of its object with "could not read its file now", and was never counted corrupt).
FILE_LOST_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EIO, errno.ELOOP, errno.ENXIO, errno.ENODEV}
)
#: The process's own passing lacks among those (out of descriptors, of memory): no fault of the
#: file's or of the disk's. A read they fail keeps its file (ChunkUnreadable, as for every error
#: not in FILE_LOST_ERRNOS); a write they fail fails alone, and does not start the tier's hold on
#: offering room (WRITE_FAILURE_HOLD_S), which is for the filesystem's errors.
PROCESS_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})

log = logging.getLogger(__name__)

#: How often (s) files that could not be removed are tried again, on the next remove().
STUCK_RETRY_S = 5.0
#: How long (s) after a chunk file could not be written (ENOSPC, EIO, a filesystem gone read-only,
#: the directory removed) the tier offers no room (room(): peers' spills, this agent's demotions).
#: Not after a write the process's own lack failed (PROCESS_ERRNOS): the disk still has the room.
WRITE_FAILURE_HOLD_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskEntry:
    alloc_id: int
    raw_bytes: int
    stored_bytes: int  # the file's length: what a spill sends
    checksum: int
    #: What the file takes on the filesystem, whole blocks: what counts against the capacity.
    footprint_bytes: int


class DiskTier:
    """Compressed chunk files under ``root``, at most ``capacity_bytes`` of them on disk.

    Thread-safe. Capacity counts what the files take on the filesystem: their stored (compressed)
    bytes rounded up to whole blocks (20,000 files of a few hundred bytes counted as 1 MiB took
    78 MiB). The compression ratio is of the stored bytes."""

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        *,
        level: int = 3,
        shuffle: str = "auto",
        max_blob_raw_bytes: int | None = None,
    ) -> None:
        """``max_blob_raw_bytes``: the largest raw size a chunk file from a peer (write_blob) may
        declare; verifying one takes its raw size in memory (None: any size this process can hold)."""
        if capacity_bytes <= 0:
            raise InvalidValue(f"disk tier capacity must be positive, got {capacity_bytes}")
        if shuffle not in ("auto", "always", "never"):
            raise InvalidValue(f"shuffle must be auto, always or never, got {shuffle!r}")
        self.root = Path(root)
        made = [d for d in (self.root, *self.root.parents) if not d.exists()]
        try:
            # The cached KV data is its owner's alone, as the host arena (0600) is: the directory
            # (made so, or made so again if an earlier build left it open) and its files.
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.root.chmod(0o700)
        except OSError as exc:
            # The reason alone: the OSError's own text repeated the path ("[Errno 20] Not a ... : '/x'").
            raise ConfigError(f"cannot create the disk tier directory {self.root}: {exc.strerror or exc}") from None
        try:
            self._check_room(self.root, capacity_bytes)
            self._lock_fd = claim_dir(self.root)
        except MooncakeError:
            # A start refused for its capacity, or whose lock file could not be written (a full
            # filesystem), left an empty directory (no lock file in it), which no later sweep of
            # abandoned tiers would remove: what this made goes.
            for directory in made:  # deepest first
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise
        self.block_bytes = self.block_size_of(self.root)
        self.capacity_bytes = capacity_bytes
        self.level = level
        self.shuffle = shuffle
        self.max_blob_raw_bytes = max_blob_raw_bytes
        self._entries: dict[int, DiskEntry] = {}
        self._storing: set[int] = set()  # ids whose files are being written
        self._used = 0  # footprints
        #: Room held for files on their way (a peer's spill: DiskInbox), by allocation id, and its
        #: sum: free room for nothing else, a demotion included, until the file is stored or goes.
        self._promises: dict[int, int] = {}
        self._promised = 0
        self._stored = 0
        self._raw = 0
        #: Footprints of removed allocations whose files are not gone yet (being removed, or could
        #: not be), by id: they stay in _used, and whoever takes one off this dict counts it off.
        self._stuck: dict[int, int] = {}
        self._stuck_tried = 0.0
        #: Until then (monotonic s) the tier offers no room: a file could not be written (room()).
        self._failing_until = 0.0
        self._lock = threading.Lock()
        self._local = threading.local()  # zstd contexts are not thread-safe; one per thread
        self._clear_leftovers()

    @staticmethod
    def block_size_of(root: Path) -> int:
        """The filesystem's allocation unit under ``root`` (4 KiB where it will not say)."""
        try:
            size = os.statvfs(root).f_frsize
        except OSError:
            size = 0
        return size if size > 0 else 4096

    def footprint(self, stored_bytes: int) -> int:
        """What a file of ``stored_bytes`` takes on the filesystem: whole blocks, one at least."""
        block = self.block_bytes
        return max(1, -(-stored_bytes // block)) * block

    @staticmethod
    def _check_room(root: Path, capacity_bytes: int) -> None:
        """Refuse a capacity the filesystem could never hold: the node table would advertise it, and
        placement and spills would count on room that is not there. Free room is not the bound, since
        it changes with other users of the disk; the filesystem's whole size is. Nor a capacity below
        one block, which no file fits in: the tier would only ever evict."""
        block = DiskTier.block_size_of(root)
        if capacity_bytes < block:  # a value the operator gave: bad input (the agent exits 2)
            raise ConfigError(
                f"disk tier capacity {capacity_bytes} B is less than one {block} B block of the filesystem "
                f"under {root}: no chunk file would fit"
            )
        try:
            st = os.statvfs(root)
        except OSError:
            return  # nothing to measure against: writes report the real error
        total = st.f_blocks * st.f_frsize
        if capacity_bytes > total:
            free = st.f_bavail * st.f_frsize
            raise NoCapacity(
                f"disk tier capacity {capacity_bytes} B ({format_size(capacity_bytes)}) is more than the "
                f"filesystem of {root} holds: {total} B ({format_size(total)}) in all, {free} B free",
                permanent=True,
            )

    def _clear_leftovers(self) -> None:
        # Files from an earlier incarnation belong to replicas that the index no longer lists (a
        # restarted agent starts empty), and temp files are writes that never finished.
        clear_chunk_files(self.root)

    # ---- accounting -------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def raw_bytes(self) -> int:
        return self._raw

    @property
    def stored_bytes(self) -> int:
        """The files' compressed bytes (used_bytes counts the blocks they take)."""
        return self._stored

    @property
    def free_bytes(self) -> int:
        """Room for a new file: less what the files already stored take and what is promised."""
        return self.capacity_bytes - self._used - self._promised

    @property
    def promised_bytes(self) -> int:
        return self._promised

    def promise(self, footprints: Mapping[int, int], *, ceiling_bytes: int | None = None) -> bool:
        """Hold room for files on their way, by allocation id (what each will take: footprint()),
        all or nothing; False when they do not fit in the free room, or would take the use,
        promises included, past ``ceiling_bytes``. Storing a file takes its promise (_store);
        drop_promises() gives back those that will not come."""
        needed = sum(footprints.values())
        self._unlink_stuck()
        with self._lock:
            if needed > self._room(ceiling_bytes):
                return False
            self._promises.update(footprints)
            self._promised += needed
            return True

    def drop_promises(self, alloc_ids: Iterable[int]) -> None:
        """Give back the room promised to these ids' files (none for a file already stored)."""
        with self._lock:
            for alloc_id in alloc_ids:
                self._promised -= self._promises.pop(alloc_id, 0)

    def room(self, *, ceiling_bytes: int | None = None) -> int:
        """Free room, no more than takes the use, promises included, up to ``ceiling_bytes``: what
        promise() grants, and what a demotion here is planned into; 0 for WRITE_FAILURE_HOLD_S after
        a file could not be written (_store)."""
        with self._lock:
            return self._room(ceiling_bytes)

    @property
    def failing(self) -> bool:
        """A file could not be written within the last WRITE_FAILURE_HOLD_S: no room is offered."""
        return time.monotonic() < self._failing_until

    def _room(self, ceiling_bytes: int | None) -> int:
        # The capacity (--disk-mem) is room the filesystem may not deliver: it fills with other
        # programs' data (ENOSPC long before the capacity), goes read-only, fails (EIO), or loses
        # the directory. Offered anyway, every pressure pass of every peer sent this tier the
        # same files again, each refused at its WRITE. After a failed write the room is held at
        # none for a while: RESERVEs of peers' spills are refused (the sender places the files
        # elsewhere, as for a peer at its mark) and this agent's own victims are not planned into
        # the disk. The accounting (free_bytes, used_bytes, what the node table publishes) is not
        # touched: it is what the files take, which this agent's pressure and its operators read.
        # Capping the room at the filesystem's free space (statvfs) would cover a full filesystem
        # only, not a read-only or failing one, nor a directory gone; the hold covers them all.
        if self.failing:
            return 0
        free = self.free_bytes
        if ceiling_bytes is not None:
            free = min(free, max(0, ceiling_bytes - self._used - self._promised))
        return free

    @property
    def objects(self) -> int:
        return len(self._entries)

    def compression_ratio(self) -> float:
        """Raw bytes over stored bytes (1.0 when empty)."""
        return self._raw / self._stored if self._stored else 1.0

    def path_of(self, alloc_id: int) -> Path:
        name = f"{alloc_id:016x}"
        return self.root / name[-2:] / (name + SUFFIX)

    def __contains__(self, alloc_id: int) -> bool:
        with self._lock:
            return alloc_id in self._entries

    def entry(self, alloc_id: int) -> DiskEntry | None:
        with self._lock:
            return self._entries.get(alloc_id)

    # ---- codec ------------------------------------------------------------------------------
    def _compressor(self) -> zstandard.ZstdCompressor:
        comp = getattr(self._local, "comp", None)
        if comp is None:
            comp = self._local.comp = zstandard.ZstdCompressor(level=self.level)
        return comp

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        dec = getattr(self._local, "dec", None)
        if dec is None:
            dec = self._local.dec = zstandard.ZstdDecompressor()
        return dec

    def encode(self, view: memoryview, *, itemsize: int) -> tuple[bytes, int]:
        """(file bytes, checksum) for ``view``; shuffles 2-byte dtypes unless told not to."""
        return encode_chunk(view, itemsize=itemsize, shuffle=self.shuffle, compressor=self._compressor())

    @staticmethod
    def parse_header(blob: bytes | bytearray | memoryview, *, where: str) -> tuple[int, int, int, int]:
        """(flags, itemsize, raw size, checksum) of a chunk file, after checking that it is one."""
        if len(blob) < HEADER.size:
            raise CorruptChunk(f"{where}: {len(blob)} B is shorter than the {HEADER.size} B header")
        magic, flags, itemsize, reserved, raw, checksum, clen = HEADER.unpack_from(blob)
        # Each fault named apart: one message for all three read "not a disk-tier chunk (magic
        # b'MCZ1', ...)" for a file whose magic was right.
        if magic != MAGIC:
            raise CorruptChunk(f"{where}: not a disk-tier chunk (magic {magic!r}, not {MAGIC!r}; {len(blob)} B)")
        if clen != len(blob) - HEADER.size:
            raise CorruptChunk(
                f"{where}: its header says {clen} B of compressed data follow, but {len(blob) - HEADER.size} B do"
            )
        if itemsize == 0:
            raise CorruptChunk(f"{where}: its header gives an item size of 0 B (at least 1)")
        if flags & ~FLAG_SHUFFLED or reserved:
            # Bits a later format may give a meaning to: such a file would be misread here.
            raise CorruptChunk(f"{where}: flags {flags:#x} and reserved field {reserved} are not this format's")
        return flags, itemsize, raw, checksum

    def decode_into(self, blob: bytes | bytearray | memoryview, dest: memoryview, *, where: str) -> int:
        flags, itemsize, raw, checksum = self.parse_header(blob, where=where)
        if raw > len(dest):
            raise InvalidValue(f"{where}: holds {raw} B but the destination has {len(dest)} B")
        body = memoryview(blob)[HEADER.size :]
        out = np.frombuffer(dest, dtype=np.uint8, count=raw)
        if flags & FLAG_SHUFFLED:
            try:
                planes = np.empty(raw, dtype=np.uint8)
            except MemoryError:  # no fault of the file's: every caller answers MooncakeErrors only
                raise MooncakeError(
                    f"{where}: no memory now for the {raw} B its byte planes decode through; the file is kept"
                ) from None
            self._decompress_into(body, memoryview(planes), where=where)
            unshuffle_planes(planes, itemsize, out)
        else:
            # Straight into the destination: no intermediate copy of the plain bytes.
            self._decompress_into(body, dest[:raw], where=where)
        if xxhash.xxh3_64_intdigest(dest[:raw]) != checksum:
            raise CorruptChunk(f"{where}: checksum mismatch; the file is corrupted")
        return int(raw)

    def _decompress_into(self, body: memoryview, dest: memoryview, *, where: str) -> None:
        """Decompress the one zstd frame of ``body`` into exactly ``len(dest)`` bytes of ``dest``."""
        filled = 0
        try:
            with self._decompressor().stream_reader(body, read_across_frames=False) as reader:
                while filled < len(dest):
                    n = reader.readinto(dest[filled:])
                    if n == 0:
                        break
                    filled += n
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise CorruptChunk(f"{where}: zstd frame is damaged: {exc}") from None
        if filled != len(dest) or extra:
            size = f"{filled} B" if filled != len(dest) else f"more than {filled} B"
            raise CorruptChunk(f"{where}: decompressed to {size}, header says {len(dest)} B")

    # ---- operations -------------------------------------------------------------------------
    def write(self, alloc_id: int, view: memoryview, *, itemsize: int = 1) -> DiskEntry:
        """Compress ``view`` into the chunk file of ``alloc_id``: temp file, fsync, rename."""
        blob, checksum = self.encode(view, itemsize=itemsize)
        return self._store(alloc_id, blob, raw_bytes=len(view), checksum=checksum)

    def write_blob(self, alloc_id: int, blob: bytes | bytearray | memoryview) -> DiskEntry:
        """Store a whole chunk file made by another agent's tier (a spill from a peer) as the file of
        ``alloc_id``. The file is decoded and its checksum verified first: a damaged transfer must
        fail here, while the sender still holds the good copy."""
        where = f"chunk file for disk allocation {alloc_id}"
        _, _, raw, checksum = self.parse_header(blob, where=where)
        try:
            content = zstandard.frame_content_size(memoryview(blob)[HEADER.size :])
        except zstandard.ZstdError as exc:
            raise CorruptChunk(f"{where}: zstd frame is damaged: {exc}") from None
        if content != raw:
            raise CorruptChunk(f"{where}: header says {raw} B, its zstd frame {content} B")
        # What a peer's file declares is checked before anything that size is made: a few bytes
        # of frame may claim gigabytes (zeros compress that far, and a header can say anything).
        limit = self.max_blob_raw_bytes
        if limit is not None and raw > limit:
            raise CorruptChunk(
                f"{where}: declares {raw} B of raw bytes, more than the {limit} B ({format_size(limit)}) "
                "this agent takes in one chunk file"
            )
        try:
            dest = bytearray(raw)
        except (MemoryError, OverflowError):
            raise CorruptChunk(f"{where}: cannot hold {raw} B to verify it") from None
        self.decode_into(blob, memoryview(dest), where=where)
        return self._store(alloc_id, blob, raw_bytes=raw, checksum=checksum)

    def read_blob(self, alloc_id: int) -> bytes:
        """The chunk file of ``alloc_id`` as stored (compressed, header included), for a spill or
        a read; CorruptChunk when its header no longer says what was stored. The checksum covers
        the plain bytes a file decodes to, and decoding checks a file against its own header: a
        file swapped for another sound one of the same size (a misdirected write, files copied
        between directories) decoded cleanly, and was served as this object's bytes."""
        entry = self.entry(alloc_id)
        if entry is None:
            raise InvalidValue(f"no disk allocation {alloc_id}")
        path = self.path_of(alloc_id)
        try:
            blob = self._read_file(path, entry.stored_bytes)
        except OSError as exc:
            if exc.errno in FILE_LOST_ERRNOS:
                raise CorruptChunk(f"{path}: cannot read: {exc.strerror}") from None
            # The process, not the file: out of descriptors under load or memory (PROCESS_ERRNOS),
            # an interrupted call, permissions changed under the agent. Taken for damage, the
            # replica was dropped and an intact object lost for good; the read fails instead.
            raise ChunkUnreadable(
                f"{path}: cannot read it now ({exc.strerror}, errno {exc.errno}); the file is kept"
            ) from None
        except MemoryError:
            raise ChunkUnreadable(
                f"{path}: no memory to read its {entry.stored_bytes} B now; the file is kept"
            ) from None
        _, _, raw, checksum = self.parse_header(blob, where=str(path))
        if raw != entry.raw_bytes or checksum != entry.checksum:
            # Damaged (or replaced) since: no caller's mistake (a destination too small), and the
            # replica must be dropped.
            raise CorruptChunk(
                f"{path}: header says {raw} B with checksum {checksum:016x}, but {entry.raw_bytes} B with "
                f"checksum {entry.checksum:016x} were stored"
            )
        return blob

    @staticmethod
    def _read_file(path: Path, length: int) -> bytes:
        """The ``length`` bytes of the chunk file at ``path``, else CorruptChunk for what is no such
        file (the agent writes only regular files of the length it records). Read whole before,
        a file grown on disk (a misdirected write appended, `truncate -s`) was held at its full
        length past the agents' read budget, a FIFO in its place blocked the READ for good, and a
        link was followed to anything."""
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size != length:
                what = "no regular file" if not stat.S_ISREG(info.st_mode) else f"{info.st_size} B"
                raise CorruptChunk(f"{path}: is {what}, but a file of {length} B was stored")
            blob = file.read(length)
        if len(blob) != length:  # shrunk between the fstat and the read
            raise CorruptChunk(f"{path}: held {len(blob)} B, but a file of {length} B was stored")
        return blob

    def _store(
        self, alloc_id: int, blob: bytes | bytearray | memoryview, *, raw_bytes: int, checksum: int
    ) -> DiskEntry:
        self._unlink_stuck()
        with self._lock:
            # Two writes of one id at once (a peer sending two WRITEs into one disk reservation):
            # the second is refused, or both would pass the check above and the first be answered
            # OK while the file holds the second's bytes.
            if alloc_id in self._entries or alloc_id in self._storing:
                raise InvalidValue(f"disk allocation {alloc_id} already exists")
            footprint = self.footprint(len(blob))
            promised = self._promises.get(alloc_id, 0)  # a peer's file takes the room held for it
            if footprint > self.free_bytes + promised:
                raise NoCapacity(
                    f"need {footprint} B on disk (a {len(blob)} B file in {self.block_bytes} B blocks); "
                    f"{self.free_bytes + promised}/{self.capacity_bytes} B free in {self.root}"
                )
            self._promises.pop(alloc_id, None)
            self._promised -= promised
            self._used += footprint  # claimed before the write so concurrent writers cannot overshoot
            self._storing.add(alloc_id)
        path = self.path_of(alloc_id)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            # The claim goes back whatever failed, even when the temp file cannot be removed
            # either (a filesystem gone read-only refuses both): the room and the id were held
            # for good, and the raw error ended every pressure pass that tried to demote.
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            with self._lock:
                self._used -= footprint
                # Its promise is not given back: the reservation may have been freed meanwhile
                # (its drop found nothing to drop), and a sender does not write one twice.
                self._storing.discard(alloc_id)
            if isinstance(exc, OSError):
                self._write_failed(exc)
                raise MooncakeError(f"cannot write {path}: {exc}") from None
            raise
        entry = DiskEntry(
            alloc_id=alloc_id, raw_bytes=raw_bytes, stored_bytes=len(blob), checksum=checksum, footprint_bytes=footprint
        )
        with self._lock:
            self._storing.discard(alloc_id)
            self._entries[alloc_id] = entry
            self._stored += len(blob)
            self._raw += raw_bytes
        return entry

    def _write_failed(self, exc: OSError) -> None:
        """Offer no room for WRITE_FAILURE_HOLD_S (_room): said once per hold, not per file. Not
        for the process's own passing lacks (PROCESS_ERRNOS): one EMFILE under a burst of
        connections held a healthy disk at no room for 10 s, and peers' spills and this agent's
        demotions went elsewhere or nowhere meanwhile."""
        if exc.errno in PROCESS_ERRNOS:
            return
        now = time.monotonic()
        with self._lock:
            held = now < self._failing_until
            self._failing_until = now + WRITE_FAILURE_HOLD_S
        if not held:
            log.warning(
                "cannot write chunk files under %s (%s): offering no disk room for %.0f s",
                self.root, exc.strerror or exc, WRITE_FAILURE_HOLD_S,
            )  # fmt: skip

    def read_into(self, alloc_id: int, dest: memoryview) -> int:
        blob = self.read_blob(alloc_id)  # its header checked against what was stored
        return self.decode_into(blob, dest, where=str(self.path_of(alloc_id)))

    def remove(self, alloc_id: int) -> bool:
        """Forget an allocation and remove its file. A file that cannot be removed (a directory
        made read-only or immutable under the agent, a directory put in its place) is logged, and
        its footprint stays counted as used until a later try takes it: forgotten, it stayed on
        the disk uncounted, and the tier promised room the filesystem did not have (and the
        error escaped into the sync that freed it, cutting the rest of its frees short)."""
        with self._lock:
            entry = self._entries.pop(alloc_id, None)
            if entry is None:
                return False
            self._stored -= entry.stored_bytes
            self._raw -= entry.raw_bytes
            self._stuck[alloc_id] = entry.footprint_bytes
        self._unlink(alloc_id, first=True)
        self._unlink_stuck()
        return True

    def _unlink(self, alloc_id: int, *, first: bool) -> None:
        path = self.path_of(alloc_id)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            if first:
                log.warning("cannot remove the chunk file %s: %s; its room stays counted as used until it can be",
                            path, exc.strerror or exc)  # fmt: skip
            return
        with self._lock:
            self._used -= self._stuck.pop(alloc_id, 0)  # once, whichever try removed it

    def _unlink_stuck(self) -> None:
        """Try the files that could not be removed again, at most every STUCK_RETRY_S: at each
        remove(), and before a write or a promise counts the free room (the room they hold
        would otherwise come back only with a remove, which a tier full of them never sees)."""
        if not self._stuck:  # the common case, read without the lock: nothing to try
            return
        now = time.monotonic()
        with self._lock:
            if not self._stuck or now - self._stuck_tried < STUCK_RETRY_S:
                return
            self._stuck_tried = now
            stuck = list(self._stuck)
        for alloc_id in stuck:
            self._unlink(alloc_id, first=False)

    def close(self, *, remove_files: bool = True) -> None:
        """Release the directory; with ``remove_files``, remove it too (the files and what the tier
        made around them), as nothing will read them again. A file that cannot go stays, and the
        rest still go."""
        if remove_files:
            for alloc_id in list(self._entries):
                self.remove(alloc_id)
        if self._lock_fd >= 0:  # idempotent; the lock goes with the descriptor
            if remove_files:
                remove_tier_dir(self.root)  # the lock file too, while it is still held
            os.close(self._lock_fd)
            self._lock_fd = -1
