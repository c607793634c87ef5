"""The WRITEs of a spill to one peer (agent/spill.py), rolling from one batch into the next.

A spill moves its victims batch by batch: reserve, write, swap. Written one batch at a time, the
streams stopped at the end of each: the last pieces' acks came back while nothing else was out,
one stream sat idle while the other finished its last piece, and the pressure thread then
settled the batch (its swap handed to the swap thread) before it built the next batch's pieces:
1-2 ms a batch in which the streams sent nothing. On two busy CPUs other threads used those
gaps (the spill figure at 1 MiB did not move); with CPUs to spare they are the peer's link idle.

Here the streams (one connection each, ``spill_jobs.WRITE_WINDOW`` WRITEs out before their acks
are read) stay up for the whole spill and pull pieces from a queue of batches: the spill queues a
batch as soon as its room is reserved, while the batch before it is still being written, and
waits for each batch's acks in order. A batch is still swapped on its own, once every piece of it
has come back, and nothing of a batch not yet settled when a stream broke is swapped, even one
wholly acked (agent/spill.py says why).

Pieces: host-tier objects go in pieces of up to ``PIECE_BYTES`` (a WRITE may cover part of a
reservation), so that the last object of a batch is not one stream's alone; a GPU or disk payload
goes whole (the peer checks a chunk file as one). The streams pull the next piece whenever they
have room, so a stream that falls behind (a busy CPU, its peer thread descheduled) does not hold
the others back (dealt in equal parts, one of two streams took up to 1.5x as long as the other).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from mooncake_store.agent.spill_jobs import PIECE_BYTES, WRITE_WINDOW, Reserved, SpillJob
from mooncake_store.errors import MooncakeError
from mooncake_store.transport.tcp import PeerConnections, Pull, PulledWrite
from mooncake_store.types import TierKind

log = logging.getLogger("mooncake.agent")


@dataclass(eq=False, slots=True)
class BatchWrites:
    """One reserved batch in the rolling writes: its pieces, and what came back for them. Guarded
    by its RollingWrites' lock."""

    jobs: list[SpillJob]
    pieces: list[PulledWrite]
    #: Pieces per job; a job is written when that many of its pieces landed.
    expected: list[int]
    views: list[memoryview]
    landed: list[int] = field(default_factory=list)
    #: Jobs with a piece whose reservation went (timed out on the peer); the stream is fine.
    gone: set[int] = field(default_factory=set)
    handed_out: int = 0  # pieces taken by the streams
    acked: int = 0
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def check_done(self) -> None:
        """Set ``done`` once no piece of it is out and none is left to go."""
        if self.acked == self.handed_out and (self.cancelled or self.handed_out == len(self.pieces)):
            self.done.set()


class RollingWrites:
    """``streams`` connections to one peer, up while a spill lasts, writing the pieces of the
    batches queued by ``add`` in order. ``wait(batch)`` gives a batch's outcome once all its
    pieces came back; ``cancel`` stops what of a batch has not gone yet; ``close`` ends the
    streams. A stream that breaks breaks the whole: the others send nothing more, and every batch
    not settled yet comes back broken once they have stopped."""

    def __init__(
        self,
        peer: PeerConnections,
        *,
        streams: int,
        pool: ThreadPoolExecutor,
        on_failure: Callable[[MooncakeError], None],
    ) -> None:
        self.peer = peer
        self._streams = max(1, streams)
        self._pool = pool
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._queue: collections.deque[BatchWrites] = collections.deque()
        self._outstanding: list[BatchWrites] = []  # queued and not yet done
        self._running: list[Future[None]] = []
        self._alive = 0
        self._closed = False
        #: A stream failed (the connection broke, the peer hung): nothing more is sent.
        self.broken = False

    # ---- the spill's side ---------------------------------------------------------------------
    def add(self, reserved: Reserved, views: list[memoryview], tier: TierKind) -> BatchWrites:
        """Queue a reserved batch: ``views`` hold each job's bytes (from the arena, or read ahead),
        in order. Starts the streams on the first batch."""
        jobs, reservations = reserved.batch, reserved.reservations
        pieces: list[PulledWrite] = []
        expected = [0] * len(jobs)
        batch = BatchWrites(jobs=jobs, pieces=pieces, expected=expected, views=views, landed=[0] * len(jobs))
        for i, (job, res, view) in enumerate(zip(jobs, reservations, views, strict=True)):
            step = PIECE_BYTES if tier == TierKind.HOST else max(1, job.wire_bytes)
            for start in range(0, job.wire_bytes, step):
                # A GPU payload is its whole allocation, which may end past the object.
                pieces.append(
                    ((batch, i), res.alloc_id, res.offset + start, view[start : min(start + step, job.wire_bytes)])
                )
                expected[i] += 1
        with self._cond:
            if self.broken or self._closed:
                batch.cancelled = True
            self._outstanding.append(batch)
            self._queue.append(batch)
            batch.check_done()
            self._cond.notify_all()
            start = not self._running and not self._closed
            if start:
                self._alive = self._streams
        if start:
            for _ in range(self._streams):
                fut = self._pool.submit(self._stream)
                self._running.append(fut)
                fut.add_done_callback(self._never_ran)
        return batch

    def wait(self, batch: BatchWrites) -> tuple[list[bool], bool]:
        """Once every piece of ``batch`` came back (or the streams stopped): (written per job: all
        its pieces landed, broken: a stream broke before the batch was settled). A batch wholly
        acked before a later one broke is given up too: written one after another, it would have
        been swapped before the break, but the peer that broke may be dead, and would take the
        batch's only copies with it. Its views are let go."""
        batch.done.wait()
        with self._cond:
            written = [batch.landed[i] == batch.expected[i] for i in range(len(batch.jobs))]
            broken = self.broken
            if batch in self._outstanding:
                self._outstanding.remove(batch)
        self._release(batch)
        for i in sorted(batch.gone):  # once per object, not per piece
            log.info("spill of %s to %s: reservation gone", batch.jobs[i].victim.key, self.peer.endpoint)
        return written, broken

    def cancel(self, batch: BatchWrites) -> None:
        """Send no more of ``batch``; what went is still acked (wait for it)."""
        with self._cond:
            batch.cancelled = True
            batch.check_done()

    def close(self) -> None:
        """Stop the streams once their writes are acked, and let every batch's views go. Batches
        not waited for are cancelled."""
        with self._cond:
            self._closed = True
            for batch in self._outstanding:
                batch.cancelled = True
                batch.check_done()
            self._cond.notify_all()
        for fut in self._running:
            with contextlib.suppress(CancelledError):  # cancelled before it ran: _never_ran
                fut.exception()  # each stream's failure was handled where it ran; this waits for it
        for batch in self._outstanding:
            self._release(batch)

    @staticmethod
    def _release(batch: BatchWrites) -> None:
        for _, _, _, piece in batch.pieces:
            piece.release()
        for view in batch.views:
            view.release()
        batch.pieces.clear()
        batch.views.clear()

    # ---- the streams' side --------------------------------------------------------------------
    def _stream(self) -> None:
        try:
            self.peer.write_pulled(self._take, window=WRITE_WINDOW, acked=self._acked)
        except MooncakeError as exc:
            log.info("spill to %s failed mid-transfer: %s", self.peer.endpoint, exc)
            # Told first: a peer that timed out (hung) must be known as such before a batch comes
            # back broken, or the spill would send it a FREE and wait out another timeout.
            self._on_failure(exc)
            self._break()
        except BaseException:
            log.exception("spill stream to %s failed", self.peer.endpoint)
            self._break()
            raise
        finally:
            self._ended()

    def _never_ran(self, fut: Future[None]) -> None:
        """A stream cancelled before it ran (the spiller closed as the agent stopped) ends here."""
        if fut.cancelled():
            self._ended()

    def _ended(self) -> None:
        with self._cond:
            self._alive -= 1
            if self._alive <= 0:
                # No stream is left to send or ack anything: what is not done now never will be.
                self.broken = self.broken or not self._closed
                for batch in self._outstanding:
                    batch.done.set()
            self._cond.notify_all()

    def _break(self) -> None:
        with self._cond:
            self.broken = True
            self._cond.notify_all()

    def _take(self, wait: bool) -> PulledWrite | Pull | None:
        with self._cond:
            while True:
                # Once a stream broke, the others finish the writes they have out and send no more.
                if self.broken:
                    return None
                queue = self._queue
                while queue and (queue[0].cancelled or queue[0].handed_out == len(queue[0].pieces)):
                    queue.popleft()
                if queue:
                    batch = queue[0]
                    piece = batch.pieces[batch.handed_out]
                    batch.handed_out += 1
                    return piece
                if self._closed:
                    return None
                if not wait:
                    return Pull.LATER
                self._cond.wait()

    def _acked(self, tag: object, landed: bool) -> None:
        batch, i = tag  # type: ignore[misc]
        with self._cond:
            batch.acked += 1
            if landed:
                batch.landed[i] += 1
            else:
                batch.gone.add(i)
            batch.check_done()
