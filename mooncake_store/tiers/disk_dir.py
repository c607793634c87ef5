"""A disk tier's directory: the lock that says its agent is alive, the sweep of directories whose
agent is gone, and the clearing of chunk and temp files (tiers/disk.py writes them)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import threading
import time
from pathlib import Path

from mooncake_store.errors import ConfigError, MooncakeError, NoCapacity

SUFFIX = ".mcz"
#: Held (flock) by the tier that owns the directory. Its name and its content (LOCK_MAGIC) are
#: what mark a directory as a disk tier's: a sweep touches no directory without both. (A lock
#: file named ".lock", as earlier builds made, marked any program's directory under --disk as a
#: dead tier's, and the sweep deleted that program's ".tmp" files and its lock.)
LOCK_NAME = ".mooncake-disk-tier.lock"
LOCK_MAGIC = b"mooncake-store disk tier\n"
#: What a sweep writes into the lock file it holds before it removes the directory: a tier claiming
#: the directory meanwhile (its agent restarted beside another's start sweep) waits for the sweep,
#: up to SWEEP_WAIT_S, instead of refusing it as "in use by another agent".
SWEEPING_MAGIC = b"mooncake-store disk tier, being swept\n"
SWEEP_WAIT_S = 60.0
#: What a tier writes under its directory (path_of): <2 hex>/<16 hex>.mcz, and .tmp while writing,
#: the subdirectory named by the file name's last two digits. Nothing else is ever removed.
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_CHUNK_FILE = re.compile(r"[0-9a-f]{14}([0-9a-f]{2})\.(mcz|tmp)")


def claim_dir(root: Path) -> int:
    """An exclusive lock on the directory for this tier's lifetime (the kernel drops it when the
    process dies). Without it a second agent started by mistake with a live agent's node id and
    disk path would clear the live agent's chunk files as leftovers before the index refused it.
    A new lock file is locked before it takes its name: other agents' start sweeps
    (sweep_abandoned_tiers) remove every tier directory whose lock file they find free, and one
    created first and locked after could be found free in between."""
    lock_path = root / LOCK_NAME
    give_up = time.monotonic() + SWEEP_WAIT_S
    moves = 0  # another process's moves between two calls, each followed by a look again
    while moves < 5:
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)  # a sweep may have taken it with a free lock
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            new = _create_locked(root, lock_path)
            if new is not None:
                return _marked(new, lock_path, created=True)
            moves += 1
            continue
        except OSError as exc:
            raise MooncakeError(f"cannot open the disk tier's lock file in {root}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            _refuse_unless_swept(fd, root, give_up)  # closes fd
            time.sleep(0.05)  # the sweep removes the directory, then this looks again
            continue
        if _still_named(fd, lock_path):
            return _marked(fd, lock_path)
        os.close(fd)  # a sweep removed that free lock file (and perhaps its directory) meanwhile
        moves += 1
    raise MooncakeError(f"cannot claim the disk tier directory {root}: its lock file kept changing")


def _refuse_unless_swept(fd: int, root: Path, give_up: float) -> None:
    """Close ``fd``, a lock file another process holds, and refuse the directory unless that
    process is a sweep removing it and ``give_up`` has not come."""
    swept = _being_swept(fd)
    os.close(fd)
    if swept and time.monotonic() < give_up:
        return
    if swept:
        raise MooncakeError(
            f"another agent's start sweep has held the disk tier directory {root} for {SWEEP_WAIT_S:.0f} s "
            "(removing a crashed tier's files); start again once it is done"
        )
    # A setting to change (exit 2, as a --listen port in use is), not a failure to retry.
    raise ConfigError(
        f"the disk tier directory {root} is in use by another agent (or another tier in this "
        "process): each agent needs a disk directory of its own"
    )


def sweep_abandoned_tiers(parent: Path, *, keep: Path) -> list[Path]:
    """Remove the directories under ``parent`` (but ``keep``) of disk tiers whose owner is gone:
    their lock file is there and free. An agent that crashed (SIGKILL, OOM) leaves its chunk
    files behind, and with the default node id (host and pid) its successor gets a directory
    of its own: nothing else would ever remove them. The files are unreachable (a dead node's
    replicas leave the index, and a restarted agent starts empty). Only what a tier writes is
    removed (chunk files, temp files, their subdirectories, the lock); a directory holding
    anything else stays. The lock is marked (SWEEPING_MAGIC) while the sweep holds it, so that a
    tier claiming the directory meanwhile waits instead of refusing. Returns the directories
    removed."""
    removed: list[Path] = []
    for lock in sorted(parent.glob(f"*/{LOCK_NAME}")):
        root = lock.parent
        if root != keep and sweep_tier_dir(root):
            removed.append(root)
    return removed


def sweep_tier_dir(root: Path) -> bool:
    """Remove one disk tier's directory if its owner is gone (its lock file is there and free),
    as :func:`sweep_abandoned_tiers` does; whether it went. What stops an agent that was killed
    (LocalCluster) sweeps its directory so."""
    lock = root / LOCK_NAME
    if root.is_symlink():  # a link leads out of parent: never followed
        return False
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its agent is alive
        if not _still_named(fd, lock):
            return False  # another sweep removed that file, and a new tier may have claimed the directory
        if os.pread(fd, len(SWEEPING_MAGIC) + 1, 0) not in (LOCK_MAGIC, SWEEPING_MAGIC):
            return False  # not a tier's lock (or one whose claim died before marking it): left alone
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, SWEEPING_MAGIC, 0)
        except OSError:
            return False
        return remove_tier_dir(root)
    finally:
        os.close(fd)


def _being_swept(fd: int) -> bool:
    """Whether the lock file another process holds says a sweep holds it. A sweep marks it just
    after it takes the lock: looked at a few times, 10 ms apart, before a tier is refused."""
    for attempt in range(3):
        try:
            if os.pread(fd, len(SWEEPING_MAGIC) + 1, 0) == SWEEPING_MAGIC:
                return True
        except OSError:
            return False
        if attempt < 2:
            time.sleep(0.01)
    return False


def _marked(fd: int, lock_path: Path, *, created: bool = False) -> int:
    """The locked descriptor of a tier's lock file, its content made LOCK_MAGIC (what a sweep
    asks of a directory before it removes anything). One this claim ``created`` and could not
    mark goes: left empty, no sweep took its directory for a tier's, and it stayed for good."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, LOCK_MAGIC, 0)
    except OSError as exc:
        if created:
            lock_path.unlink(missing_ok=True)  # still locked by us: no other claim holds it
        os.close(fd)
        raise _lock_file_error(f"cannot write the disk tier's lock file {lock_path}", exc) from None
    return fd


def _lock_file_error(what: str, exc: OSError) -> MooncakeError:
    """A lock file that could not be made: no room (blocks, or inodes: a filesystem whose inodes
    ran out refused only the file's creation, and that was exit 1) is NoCapacity, exit 5."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoCapacity(
            f"{what}: {exc.strerror} (the filesystem of --disk has no room left; free some, or give another directory)",
            permanent=True,
        )
    return MooncakeError(f"{what}: {exc}")


def _claiming_name() -> str:
    # Per process and thread: two tiers claiming one directory at once each make their own.
    return f"{LOCK_NAME}.claiming-{os.getpid()}-{threading.get_ident()}"


def _still_named(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _create_locked(root: Path, lock_path: Path) -> int | None:
    """A new lock file, locked before it takes its name (a hard link to a file of this process's
    own); None when another process's move came between (a sweep took the directory, or another
    tier named its lock first): the caller looks again."""
    claiming = root / _claiming_name()
    try:
        fd = os.open(claiming, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except FileNotFoundError:
        return None  # the directory went
    except OSError as exc:
        raise _lock_file_error(f"cannot create the disk tier's lock file in {root}", exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file no other process has opened yet
        os.link(claiming, lock_path)
        return fd
    except (FileExistsError, FileNotFoundError):
        os.close(fd)
        return None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_HARD_LINKS:
            raise _lock_file_error(f"cannot create the disk tier's lock file in {root}", exc) from None
        return _create_in_place(lock_path)
    finally:
        claiming.unlink(missing_ok=True)


#: What a filesystem without hard links (vfat, exFAT, some network and FUSE mounts) answers.
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def _create_in_place(lock_path: Path) -> int | None:
    """Where there are no hard links: created, then locked, then checked that it is still the
    one named (a sweep may take it in between; then the caller looks again)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except (FileExistsError, FileNotFoundError):
        return None
    except OSError as exc:
        raise _lock_file_error(f"cannot create the disk tier's lock file {lock_path}", exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)  # a sweep holds it: it is taking the directory
        return None
    if _still_named(fd, lock_path):
        return fd
    os.close(fd)
    return None


def _tier_subdirs(root: Path) -> list[Path]:
    """The subdirectories path_of makes (two hex digits), not links: a link could lead anywhere."""
    try:
        return [d for d in root.iterdir() if _SUBDIR.fullmatch(d.name) and not d.is_symlink() and d.is_dir()]
    except OSError:
        return []


def chunk_file_paths(root: Path) -> list[Path]:
    """The chunk and temp files of a tier's directory: only names path_of makes, each in the
    subdirectory its name selects (the id in hex is the name's stem; ".tmp" while written)."""
    found: list[Path] = []
    for sub in _tier_subdirs(root):
        try:
            found.extend(p for p in sub.iterdir() if (m := _CHUNK_FILE.fullmatch(p.name)) and m.group(1) == sub.name)
        except OSError:
            continue
    return found


def clear_chunk_files(root: Path) -> None:
    """Remove the chunk and temp files of a tier's directory (chunk_file_paths)."""
    for path in chunk_file_paths(root):
        with contextlib.suppress(OSError):  # one that cannot go stays: the rest still go
            path.unlink(missing_ok=True)


def remove_tier_dir(root: Path) -> bool:
    """Remove a disk tier's directory: its chunk and temp files, its subdirectories (when that
    leaves them empty), its lock file, and itself if nothing else is in it. Whether it went."""
    clear_chunk_files(root)
    for sub in _tier_subdirs(root):
        with contextlib.suppress(OSError):
            sub.rmdir()  # only if empty
    try:
        for claiming in root.glob(f"{LOCK_NAME}.claiming-*"):
            # Left by a claim that died halfway; a live claimer that loses its file looks again.
            claiming.unlink(missing_ok=True)
        (root / LOCK_NAME).unlink(missing_ok=True)
        root.rmdir()
    except OSError:
        return False  # something else in it, or a directory that cannot be changed: left as it is
    return True
