"""Bytes the agent holds at once for READs of objects it cannot send from its arena in place.

A READ of a disk-tier object decodes its whole chunk file (its checksum covers every byte), and one
of a GPU-tier object copies it whole to host memory; the copy is held until the reply has gone out,
which a reader that stops reading delays to the request's deadline. Unbounded, a few hundred
connections each holding one unread READ of a large object (a file of a few KB decodes to the size
of the memory tier: zeros compress) took the host's memory, and an out-of-memory kill loses every
object in the arena. Arriving chunk files are bounded the same way (agent/inbox.py, STAGING_BYTES).
"""

from __future__ import annotations

import threading
import time

#: Decoded or copied-out bytes held for READs at once (one READ is always let through alone, however
#: large: a single reader of the largest object is no attack).
READ_BUDGET_BYTES = 256 << 20
#: The longest a READ waits for the budget before it is answered STALE: well within a client's
#: wait for a reply (timeout_s, 10 s by default), so that the reader hears why and goes to another
#: replica or asks again, instead of timing out and dropping the connection.
READ_BUDGET_WAIT_S = 2.0


class ReadBudget:
    def __init__(self, limit_bytes: int = READ_BUDGET_BYTES) -> None:
        self._limit = limit_bytes
        self._held = 0
        self._readers = 0
        self._cond = threading.Condition()

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
            self._held -= nbytes
            self._readers -= 1
            self._cond.notify_all()

    @property
    def held_bytes(self) -> int:
        return self._held
