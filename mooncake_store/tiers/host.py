"""The host-DRAM tier: one POSIX shared-memory segment per agent, in ``/dev/shm``.

The agent creates the segment (:class:`HostArena`) and clients on the same host map it
(:class:`SharedSegment`), so a same-host put/get is a ``memcpy`` into or out of the mapping.

``multiprocessing.shared_memory`` is deliberately not used: on Python 3.11 its resource tracker
registers every segment a process *attaches* to and unlinks it when that process exits, so one client
exiting would delete the agent's arena. Plain ``os.open`` + ``mmap`` has no such side effects.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import logging
import mmap
import os
import re
import secrets
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

from mooncake_store.errors import (
    ConnectError,
    InvalidValue,
    MooncakeError,
    NoCapacity,
    ProtocolError,
)

if TYPE_CHECKING:
    from mooncake_store.tiers.gpu_arrays import PinnedHost

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")

#: Longest segment name; NAME_MAX is 255 and this leaves room for tooling that adds suffixes.
MAX_SEGMENT_NAME = 200

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_VALID_NAME = re.compile(r"[A-Za-z0-9._-]+")

# MAP_POPULATE is Linux-only (and exposed by Python's mmap module since 3.10).
_MAP_POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)


#: Characters of an agent's incarnation in its segment's name.
INCARNATION_CHARS = 12


def segment_name(namespace: str, node_id: str, pid: int | None = None, incarnation: str = "") -> str:
    """``mooncake.<len>.<namespace>.<node_id>.<pid>[-<incarnation>]`` with every character outside
    ``[A-Za-z0-9._-]`` replaced by ``_`` in each part, at most :data:`MAX_SEGMENT_NAME` characters;
    ``<len>`` is the namespace's length.

    The length says where the namespace ends: both names may hold dots, and without it namespace
    "a" with node "b.c" and namespace "a.b" with node "c" named the same segment, and an agent of
    "a" swept the dead arenas of "a.b" as its own namespace's. (A separator outside the names'
    characters would do it too, but clients of earlier versions refuse to map such a name.) The
    pid and the incarnation make a restarted agent's segment distinct from its predecessor's, even
    under the same pid (PID 1 in a container); when the name is too long the middle is cut, never
    the suffix, so that uniqueness survives truncation.
    """
    suffix = f".{os.getpid() if pid is None else pid}" + (f"-{incarnation}" if incarnation else "")
    return _bounded(namespace_prefix(namespace) + _UNSAFE.sub("_", node_id), suffix)


def _bounded(prefix: str, suffix: str) -> str:
    """``prefix + suffix`` in MAX_SEGMENT_NAME characters, cut in the prefix's end, never the suffix."""
    return prefix[: MAX_SEGMENT_NAME - len(suffix)] + suffix


def namespace_prefix(namespace: str) -> str:
    """How the names of ``namespace``'s segments begin, and no other namespace's."""
    safe = _UNSAFE.sub("_", namespace)
    return f"mooncake.{len(safe)}.{safe}."


def _legacy_name(namespace: str, node_id: str, pid: int, incarnation: str) -> str:
    """The name an agent of an earlier version gave its segment (the namespace unmarked): one of
    this node's crashed predecessors may have left it."""
    return _bounded(_UNSAFE.sub("_", f"mooncake.{namespace}.{node_id}"), f".{pid}-{incarnation}")


#: How segment_name begins: the length of the namespace that follows.
_MARKED = re.compile(r"mooncake\.(\d+)\.")


def _is_marked(name: str) -> bool:
    """Whether ``name`` reads as segment_name's (its namespace marked by its length): then it is
    no earlier version's. Namespace "3.ns1"'s earlier name for node "agent-0" is namespace "ns1"'s
    name for it now, and an agent of "3.ns1" removed the dead arena that "ns1"'s clients could
    still read until its node's deadline."""
    match = _MARKED.match(name)
    if match is None:
        return False
    end = match.end() + int(match[1])  # where the marked namespace would end
    return name[end : end + 1] == "."


def segment_digest(name: str) -> int:
    """A 64-bit digest of a segment name: a FENCE reply carries the fencing agent's, so that a
    writer copies only into the arena of the agent that holds its reservations."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def segment_pattern(namespace: str, node_id: str, pid: int) -> str:
    """A glob matching the segment an agent of ``pid`` names, whatever its incarnation: for
    removing the segment of an agent that died before it said its name. The incarnation's length
    is fixed, so that no other node's name (one with a dot and digits after this node id) matches."""
    return segment_name(namespace, node_id, pid=pid, incarnation="?" * INCARNATION_CHARS)


def segment_paths(name_or_pattern: str) -> list[Path]:
    """The segments a recorded name stands for: itself, or what a pattern (segment_pattern, or an
    earlier version's with ``*``) matches in /dev/shm."""
    return sorted(SHM_DIR.glob(name_or_pattern)) if glob.has_magic(name_or_pattern) else [SHM_DIR / name_or_pattern]


#: The suffix segment_name puts on a name: ``.<pid>-<incarnation>``.
_SUFFIX = re.compile(r"\.(\d+)-([A-Za-z0-9._]+)$")


def sweep_abandoned_segments(
    namespace: str, node_id: str, *, keep: str, listed: frozenset[str] | None = None
) -> list[str]:
    """Remove the segments of earlier agents in ``namespace`` that no process holds (an agent
    holds a lock on its segment for as long as it maps it: HostArena.create): an agent killed
    without its stop left its arena in /dev/shm, and an agent restarted after each crash leaked one
    arena's memory per crash. ``keep``: the caller's own. Returns the names removed.

    Those of ``node_id`` go in any case. Those of other nodes go only when ``listed`` (the shm
    names the node table lists, dead nodes not yet reaped included) is given and does not name
    them: with the default node id (host-pid) every incarnation is a node of its own, and only a
    sweep past its own id frees a crashed predecessor's arena; one still listed may yet be read by
    same-host clients until its node's deadline, and goes at a later start. An agent calls it once
    registered, with ``listed``, and before, without (``keep`` "": its own node id's only), when
    /dev/shm has no room for its arena. A live agent holds its lock, and is skipped in any case."""
    removed = []
    own_prefix = namespace_prefix(namespace)
    for path in SHM_DIR.glob("mooncake.*"):
        match = _SUFFIX.search(path.name)
        if path.name == keep or match is None:
            continue
        pid, incarnation = int(match[1]), match[2]
        own = path.name == segment_name(namespace, node_id, pid=pid, incarnation=incarnation) or (
            path.name == _legacy_name(namespace, node_id, pid, incarnation) and not _is_marked(path.name)
        )
        if not own and (listed is None or path.name in listed or not path.name.startswith(own_prefix)):
            continue  # another node's (or namespace's), or one the node table still names
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its agent is alive
        else:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        finally:
            os.close(fd)
    return removed


def _create_locked(path: Path) -> int:
    """A new, empty file at ``path``, already locked when it takes its name: locked only after it
    was sized and mapped (seconds for a large arena), it was unlocked to another agent's start
    sweep of the same node id (a second cluster in the namespace, a demo), which deleted it, and
    the agent advertised a segment no reader could open. The lock is let go when this process dies
    however it dies, and a later agent of the node then removes the segment
    (sweep_abandoned_segments). Never adopts an existing file (a live agent with a reused pid name)."""
    hidden = path.with_name(f".{path.name}.{secrets.token_hex(4)}.new")  # no sweep's glob matches it
    exists = MooncakeError(f"shared-memory segment {path} already exists")
    fd: int | None = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else can hold it
        os.link(hidden, path)  # fails where the name exists, as O_EXCL would
    except FileExistsError:
        os.close(fd)
        raise exists from None
    except OSError:
        os.close(fd)  # no hard links here: named first, then locked within microseconds
        fd = None
    except BaseException:
        os.close(fd)
        raise
    finally:
        hidden.unlink(missing_ok=True)
    if fd is not None:
        return fd
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise exists from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:  # a sweep locked it in those microseconds, and removes it
        os.close(fd)
        raise MooncakeError(
            f"shared-memory segment {path} was taken by another process as it was created: {exc}"
        ) from None
    return fd


def memory_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo: what the kernel can give without swapping; None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def arenas_refused(count: int, size_bytes: int, *, prefault: bool = True) -> str | None:
    """Why ``count`` arenas of ``size_bytes`` started together would not fit, or None: each agent
    checks /dev/shm for its own arena only, and agents started at once all passed. Prefaulted (the
    default), they take memory at start too: past MemAvailable, arenas that /dev/shm had room for
    (its size is set apart from the memory) had the kernel's OOM killer end processes of the
    machine, not the start refused (2 agents x 11.5 GiB on 24 GiB)."""
    need = count * size_bytes
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None  # no /dev/shm to measure: the agent reports the real error
    free = st.f_bavail * st.f_frsize
    if need > free:
        return f"{count} arena(s) x {size_bytes} B = {need} B of shared memory needed, but {SHM_DIR} has {free} B free"
    available = memory_available_bytes() if prefault else None
    if available is not None and need > available:
        return (
            f"{count} arena(s) x {size_bytes} B = {need} B of memory needed (arenas are prefaulted at start), "
            f"but the machine has {available} B available (MemAvailable)"
        )
    return None


def _check_name(name: object) -> str:
    # The name becomes a path component under /dev/shm: "/" or ".." would escape the directory.
    if not isinstance(name, str) or not _VALID_NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidValue(f"segment name must match [A-Za-z0-9._-]+, got {name!r:.80}")
    if len(name) > MAX_SEGMENT_NAME:
        raise InvalidValue(f"segment name is {len(name)} characters; the limit is {MAX_SEGMENT_NAME}")
    return name


def _check_size(size_bytes: object) -> int:
    if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0:
        raise InvalidValue(f"size_bytes must be an int > 0, got {size_bytes!r:.80}")
    return size_bytes


class _Mapping:
    """A read-write ``MAP_SHARED`` mapping of a file in ``/dev/shm``; shared by both sides."""

    __slots__ = (
        "__weakref__",
        "_base",
        "_device_copies",
        "_mm",
        "_pin",
        "_pin_cond",
        "_pin_refused",
        "_unpin",
        "name",
        "path",
        "size_bytes",
    )

    def __init__(self, name: str, path: Path, size_bytes: int, mm: mmap.mmap) -> None:
        self.name = name
        self.path = path
        self.size_bytes = size_bytes
        self._mm: mmap.mmap | None = mm
        # Views are sliced from one base memoryview rather than memoryview(mm) each time, so the
        # mapping has one export to release at close.
        self._base: memoryview | None = memoryview(mm)
        self._pin: PinnedHost | None = None
        self._pin_refused = False
        #: Guards the pinning and counts the device copies through views of this mapping: the
        #: close unpins only once none runs.
        self._pin_cond = threading.Condition()
        self._device_copies = 0
        #: Unpins once, from close() or when the mapping is collected without one.
        self._unpin: weakref.finalize | None = None

    @property
    def closed(self) -> bool:
        return self._base is None

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of ``[offset, offset + length)``. Callers must ``release()`` views (or drop
        them) before :meth:`close`; a view kept past close keeps the pages mapped."""
        base = self._base
        if base is None:
            raise MooncakeError(f"segment {self.path} is closed")
        for what, value in (("offset", offset), ("length", length)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidValue(f"{what} must be int, got {type(value).__name__}: {value!r:.80}")
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise InvalidValue(
                f"view offset={offset} length={length} is outside segment {self.name} of size {self.size_bytes} B"
            )
        try:
            return base[offset : offset + length]
        except ValueError:  # released by a close() in another thread since it was read above
            raise MooncakeError(f"segment {self.path} is closed") from None

    @property
    def pinned(self) -> bool:
        pin = self._pin
        return pin is not None and pin.registered

    def pin_for_devices(self, device_id: int | None = None) -> bool:
        """Page-lock the whole mapping for CUDA copies to and from ``device_id`` (once; the first
        call pays for it, about what touching every page costs). False where CUDA refuses: device
        copies then stay pageable, and the reason is logged once. Only called on paths that
        already use CUDA."""
        with self._pin_cond:
            if self._pin is not None:
                return True
            base = self._base
            if self._pin_refused or base is None:
                return False
            from mooncake_store.tiers.gpu_arrays import PinnedHost, host_pointer

            try:
                pin = PinnedHost(host_pointer(base), self.size_bytes, device_id)
            except MooncakeError as exc:
                self._pin_refused = True
                log.warning("device copies through %s stay pageable: %s", self.path, exc)
                return False
            self._pin = pin
            # A mapping dropped without close() is unpinned when collected, before its slots (the
            # mmap) go: the pages must never be unmapped while registered.
            self._unpin = weakref.finalize(self, pin.close)
            self._unpin.atexit = False  # at exit the registration ends with the process
            return True

    @contextlib.contextmanager
    def device_view(self, offset: int, length: int) -> Iterator[memoryview]:
        """:meth:`view` for a CUDA copy, counted whether the mapping is pinned yet or not, so that
        close() unpins only once the copy is done with it. A thread must not close the mapping
        while it holds one of these (the close would wait for it)."""
        with self._pin_cond:
            self._device_copies += 1
        try:
            view = self.view(offset, length)
            try:
                yield view
            finally:
                view.release()
        finally:
            with self._pin_cond:
                self._device_copies -= 1
                if not self._device_copies:
                    self._pin_cond.notify_all()

    def _unmap(self) -> None:
        with self._pin_cond:
            base, mm, unpin = self._base, self._mm, self._unpin
            self._base = None  # no view (device or not) starts from here on
            self._mm = None
            self._pin = None
            self._unpin = None
            if unpin is not None:
                # No timeout: a copy is one synchronous cudaMemcpy, and unpinning under a running
                # DMA, or unmapping a range still registered, is worse than waiting.
                self._pin_cond.wait_for(lambda: self._device_copies == 0)
        if unpin is not None:
            unpin()  # before the unmap: a later mapping at this address must not inherit it
        if base is not None:
            base.release()
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # A caller still holds a view. Unmapping now would leave that view pointing at freed
                # address space (a segfault on next use), so the mmap object is dropped instead and
                # the pages are unmapped when the last view is garbage-collected.
                pass

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._unmap()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"{type(self).__name__}({self.name!r}, size_bytes={self.size_bytes}, {state})"


def _map(fd: int, size_bytes: int, *, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class HostArena(_Mapping):
    """Agent side: creates and owns the segment; :meth:`close` unlinks it by default."""

    __slots__ = ()

    @classmethod
    def create(cls, name: str, size_bytes: int, *, prefault: bool = True) -> HostArena:
        """Create ``/dev/shm/<name>`` of ``size_bytes`` and map it.

        ``prefault`` reserves the tmpfs pages and maps them up front, so the first put does not pay
        page faults and a full ``/dev/shm`` fails here with :class:`NoCapacity` instead of as a
        SIGBUS on some later write.
        """
        name = _check_name(name)
        size_bytes = _check_size(size_bytes)
        path = SHM_DIR / name
        st = os.statvfs(SHM_DIR)
        available = st.f_bavail * st.f_frsize
        if size_bytes > available:
            raise NoCapacity(f"need {size_bytes} B in {SHM_DIR} for segment {name}; {available} B available")
        fd = _create_locked(path)
        try:
            os.ftruncate(fd, size_bytes)
            if prefault:
                try:
                    # Allocates the tmpfs pages now; statvfs above is only a snapshot that another
                    # process can race with.
                    os.posix_fallocate(fd, 0, size_bytes)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    st = os.statvfs(SHM_DIR)
                    raise NoCapacity(
                        f"need {size_bytes} B in {SHM_DIR} for segment {name}; {st.f_bavail * st.f_frsize} B available"
                    ) from None
            mm = _map(fd, size_bytes, populate=prefault)
            if prefault and not _MAP_POPULATE:
                # No MAP_POPULATE: write one byte per page to take the faults now. The file is
                # fresh, so writing 0 does not change its contents.
                for page in range(0, size_bytes, mmap.PAGESIZE):
                    mm[page] = 0
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        # The lock (_create_locked) is held while the mapping lives: mmap keeps a duplicate of the
        # descriptor, and the lock is the open file's; ours is no longer needed.
        os.close(fd)
        return cls(name, path, size_bytes, mm)

    def close(self, *, unlink: bool = True) -> None:
        """Unmap and (by default) unlink the segment. Idempotent. Callers must release their views
        first; if one is still held the mapping stays alive until it is dropped, but the file is
        unlinked regardless so that ``/dev/shm`` does not leak."""
        self._unmap()
        if unlink:
            self.path.unlink(missing_ok=True)


class SharedSegment(_Mapping):
    """Client side: maps a segment an agent on the same host created. Never unlinks it."""

    __slots__ = ()

    @classmethod
    def attach(cls, name: str, size_bytes: int, *, populate: bool = True) -> SharedSegment:
        """Map the first ``size_bytes`` of ``/dev/shm/<name>`` read-write; ``populate`` maps its
        pages now (faults later cost ~4x the copy), which allocates those of a sparse segment.

        Raises :class:`ConnectError` when the segment is missing (the agent is gone or on another
        host) and :class:`ProtocolError` when it is smaller than the agent advertised.
        """
        name = _check_name(name)
        size_bytes = _check_size(size_bytes)
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ConnectError(f"shared-memory segment {path} does not exist") from None
        except PermissionError:
            raise ConnectError(f"shared-memory segment {path} is not readable/writable by us") from None
        except OSError as exc:  # EMFILE, ENFILE: this process's limits, not the segment's fault
            raise ConnectError(f"cannot open shared-memory segment {path}: {exc.strerror or exc}") from None
        try:
            actual = os.fstat(fd).st_size
            if actual < size_bytes:
                raise ProtocolError(f"shared-memory segment {path} is {actual} B; the agent advertised {size_bytes} B")
            mm = _map(fd, size_bytes, populate=populate)
        except OSError as exc:
            # No room to map it here (ENOMEM under an address-space or container limit, or
            # vm.max_map_count): a ConnectError, so that a read goes to another replica or over
            # TCP, as the agents' own peer mappings do; a bare OSError escaped get and put.
            raise ConnectError(
                f"cannot map {size_bytes} B of shared-memory segment {path}: {exc.strerror or exc}"
            ) from None
        finally:
            os.close(fd)
        return cls(name, path, size_bytes, mm)
