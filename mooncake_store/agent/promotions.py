"""Promotions after disk reads, on a thread of their own.

A read served from the disk tier brings the object back to host memory (``promote_on_read``):
a host block, a copy, then a compare-and-swap of its location in the index (agent/moves.py). That
used to run on the connection's own thread once the reply was out, so the client's next request
on that connection waited for the index's round trip, and for as long as the index was slow or
away (up to the agent's index timeout). Here the connection hands the bytes it already read over
and goes on serving.

The queue is bounded by bytes: a promotion is a bet on another read, and a burst of disk reads
must not pile copies up in memory. A read that does not fit is not promoted (the object stays on
disk, whole, and its next read may promote it), and one already queued is not queued twice.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from mooncake_store.errors import MooncakeError

if TYPE_CHECKING:
    from mooncake_store.agent.moves import LocalMoves

log = logging.getLogger("mooncake.agent")

#: Bytes of read objects held for promotion at once (the one being promoted included); one object
#: larger than this is still taken when nothing else is queued.
MAX_QUEUED_BYTES = 64 << 20


class PromotionQueue:
    def __init__(self, moves: LocalMoves, *, join_s: float) -> None:
        self._moves = moves
        self._join_s = join_s
        self._max_bytes = MAX_QUEUED_BYTES
        #: Disk alloc id -> its bytes, in the order the reads were served; the first is the one
        #: being promoted while the worker runs.
        self._queued: dict[int, bytearray] = {}
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None  # started by the first promotion

    def offer(self, disk_id: int, data: bytearray) -> bool:
        """Queue a promotion; False when it is not made (queued already, no room, closed)."""
        with self._cond:
            if self._closed or disk_id in self._queued:
                return False
            queued = sum(map(len, self._queued.values()))
            if queued and queued + len(data) > self._max_bytes:
                log.debug("promotion of allocation %d left out: %d bytes already queued", disk_id, queued)
                return False
            self._queued[disk_id] = data
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="mc-promote", daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # no thread to be had: this read is not promoted
                    del self._queued[disk_id]
                    log.warning("promotion of allocation %d left out: %s", disk_id, exc)
                    return False
                self._thread = thread
            self._cond.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                disk_id, data = next(iter(self._queued.items()))
            try:
                self._moves.promote(disk_id, data)
            except MooncakeError as exc:
                log.info("promotion of allocation %d failed: %s", disk_id, exc)
            except Exception:
                # A bug must cost this promotion, not every later one (the thread would end).
                log.exception("promotion of allocation %d failed unexpectedly", disk_id)
            finally:
                with self._cond:
                    self._queued.pop(disk_id, None)

    def close(self) -> None:
        """Drop what is queued and wait (up to ``join_s``) for a promotion under way: the agent
        closes the arena it copies into next."""
        with self._cond:
            self._closed = True
            self._queued.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._join_s)
