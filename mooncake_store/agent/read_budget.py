"""Bytes the agent holds at once for READs of objects it cannot send from its arena in place.

A READ of a disk-tier object decodes its whole chunk file (its checksum covers every byte), and one
of a GPU-tier object copies it whole to host memory; the copy is held until the reply has gone out,
which a reader that stops reading delays to the request's deadline. Unbounded, a few hundred
connections each holding one unread READ of a large object (a file of a few KB decodes to the size
of the memory tier: zeros compress) took the host's memory, and an out-of-memory kill loses every
object in the arena. Arriving chunk files are bounded the same way (agent/inbox.py, STAGING_BYTES).

READs of one object at once share one copy (``ReadBudget.shared``), charged once: the stripes of a
striped READ, or the readers of one hot chunk file after a restart, each decoded the whole file
and were each charged the whole object, so the stripes of an object over half the budget ran one
after another, each decoding it again. An alloc id is never reused (AllocationTable's ids count
up), so a copy made for one stays that object's bytes for as long as a READ shares it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from mooncake_store.types import TierKind

#: Decoded or copied-out bytes held for READs at once (one READ is always let through alone, however
#: large: a single reader of the largest object is no attack).
READ_BUDGET_BYTES = 256 << 20
#: The longest a READ waits for the budget before it is answered STALE: well within a client's
#: wait for a reply (timeout_s, 10 s by default), so that the reader hears why and goes to another
#: replica or asks again, instead of timing out and dropping the connection.
READ_BUDGET_WAIT_S = 2.0


class OtherTierCopy(NamedTuple):
    """A whole object of another tier in host memory: its bytes, the offset its first byte has in
    READ's terms (its place in the GPU arena; 0 on disk) and the tier it was read from."""

    data: bytearray
    base: int
    tier: TierKind


class SharedCopy:
    """What a READ sharing a copy got: ``copy`` (None when it could not be made: no such object
    now, damaged, no memory), or ``busy`` (the budget stayed full until the READ's deadline)."""

    __slots__ = ("busy", "charged", "copy", "failure", "ready", "users")

    def __init__(self) -> None:
        self.copy: OtherTierCopy | None = None
        self.busy = False
        #: What making it raised (a chunk file kept but not readable now): raised to every READ
        #: that waited to share it too, as to the one that made it (without it they found no
        #: copy, and told their readers the agent no longer held the object).
        self.failure: Exception | None = None
        self.users = 1
        #: What it took of the budget, once it did (None: nothing; an empty object takes 0 B,
        #: and its reader still counts until it is given back).
        self.charged: int | None = None
        self.ready = threading.Event()


class ReadBudget:
    def __init__(self, limit_bytes: int = READ_BUDGET_BYTES) -> None:
        self._limit = limit_bytes
        self._held = 0
        self._readers = 0
        self._cond = threading.Condition()
        #: alloc id -> the copy READs of it share now (made by the first, dropped with the last).
        self._copies: dict[int, SharedCopy] = {}

    @property
    def limit_bytes(self) -> int:
        return self._limit

    @contextlib.contextmanager
    def shared(
        self, alloc_id: int, nbytes: int, *, deadline: float, make: Callable[[], OtherTierCopy | None]
    ) -> Iterator[SharedCopy]:
        """The copy of ``alloc_id`` (``nbytes``) for one READ, held until the block ends: the
        READ that finds none takes the budget (waiting up to ``deadline``) and makes it with
        ``make``; the ones that come while it is held share it (waiting for it up to ``deadline``)
        and charge nothing more. What ``make`` raised is raised to the READs sharing its copy
        too. A copy that could not be made, or not in time, is not shared with READs that come
        after: they try again."""
        held = self._join(alloc_id, nbytes, deadline=deadline, make=make)
        try:
            yield held
        finally:
            self._leave(alloc_id, held)

    def _join(
        self, alloc_id: int, nbytes: int, *, deadline: float, make: Callable[[], OtherTierCopy | None]
    ) -> SharedCopy:
        while True:
            with self._cond:
                held = self._copies.get(alloc_id)
                if held is None:
                    held = self._copies[alloc_id] = SharedCopy()
                    maker = True
                else:
                    held.users += 1
                    maker = False
            if maker:
                try:
                    if self.acquire(nbytes, deadline=deadline):
                        held.charged = nbytes
                        held.copy = make()
                    else:
                        held.busy = True
                except BaseException as exc:
                    if isinstance(exc, Exception):
                        held.failure = exc  # before ready is set, for the READs waiting on it
                    self._leave(alloc_id, held)
                    raise
                finally:
                    if held.copy is None:
                        self._forget(alloc_id, held)
                    held.ready.set()
                return held
            if not held.ready.wait(max(0.0, deadline - time.monotonic())):
                self._leave(alloc_id, held)
                joined = SharedCopy()  # not made in time for this READ (in no map, charged nothing)
                joined.busy = True
                return joined
            if held.failure is not None:
                self._leave(alloc_id, held)
                raise held.failure
            if held.busy and time.monotonic() < deadline:
                # The READ that was to make it met the budget full until its own deadline, which
                # came before this one's: this READ waits out the rest of its own, as it would have
                # had it come first, rather than be refused with that one.
                self._leave(alloc_id, held)
                continue
            return held

    def _leave(self, alloc_id: int, held: SharedCopy) -> None:
        with self._cond:
            held.users -= 1
            if held.users == 0:
                if self._copies.get(alloc_id) is held:
                    del self._copies[alloc_id]
                if held.charged is not None:
                    self._release_locked(held.charged)

    def _forget(self, alloc_id: int, held: SharedCopy) -> None:
        with self._cond:
            if self._copies.get(alloc_id) is held:
                del self._copies[alloc_id]

    def acquire(self, nbytes: int, *, deadline: float) -> bool:
        """Take ``nbytes`` (waiting, up to ``deadline`` on time.monotonic(), for READs in flight to
        end); False when they did not in time, and the READ is refused (STALE: its reader tries
        another replica, or asks again)."""
        with self._cond:
            while self._readers and self._held + nbytes > self._limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self._held += nbytes
            self._readers += 1
            return True

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._release_locked(nbytes)

    def _release_locked(self, nbytes: int) -> None:
        self._held -= nbytes
        self._readers -= 1
        self._cond.notify_all()

    @property
    def held_bytes(self) -> int:
        return self._held
