"""The index work of puts under way, which close() waits for before it closes the index.

close() (the client's, or a PrefixCache's) first cuts the agent connections of the operations under
way, so that none waits on a stalled agent; a put cut so fails at once and revokes its pending
record. What it cannot cut is a put that is past its transfers: its commit is one index call. So a
put counts itself in from its first index write (put_start) to its last (the commit, or the revoke
of what it abandoned), a commit refuses to start once the put was interrupted, and close() waits
for the puts still counted in. After close() returns, no commit starts and none is under way: a
put that committed before then stays stored, any other stores nothing, and none reopens the
index's connections after it was closed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from mooncake_store.errors import MooncakeError
from mooncake_store.transport.cancel import Cancel, current_cancel


class InFlight:
    """Puts under way between their first and last index write, each with the Cancel it runs
    under (a PrefixCache's, or none). ``interrupted`` says why a call must not go on (the client
    is closed, or the calling thread's Cancel was cancelled), or None."""

    def __init__(self, interrupted: Callable[[], MooncakeError | None]) -> None:
        self._interrupted = interrupted
        self._cond = threading.Condition()
        #: token -> (the Cancel the put runs under, the thread it runs on)
        self._under_way: dict[int, tuple[Cancel | None, int]] = {}
        self._next = 0

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Count the calling put in for the block; refused (the interruption raised) once it was
        interrupted. The check and the count happen under the lock drain() looks under, so a put
        either is counted before a drain looks, or sees the interruption that came first."""
        with self._cond:
            error = self._interrupted()
            if error is not None:
                raise error
            token = self._next
            self._next += 1
            self._under_way[token] = (current_cancel(), threading.get_ident())
        try:
            yield
        finally:
            with self._cond:
                del self._under_way[token]
                self._cond.notify_all()

    def check(self) -> None:
        """Before a commit: raise the interruption, if any. A close() that comes after this waits
        for the commit (the put is still counted in)."""
        error = self._interrupted()
        if error is not None:
            raise error

    def drain(self, timeout_s: float, *, cancel: Cancel | None = None) -> bool:
        """Wait until no put is under way (only those under ``cancel`` when given), at most
        ``timeout_s``: a put's index calls are bounded by their own timeouts. True if none is.
        A put of the calling thread itself is not waited for: it cannot go on until this returns.
        (That does not make close() safe in a signal handler: see Client.close.)"""
        deadline = time.monotonic() + timeout_s
        me = threading.get_ident()

        def idle() -> bool:
            return not any((cancel is None or c is cancel) and t != me for c, t in self._under_way.values())

        with self._cond:
            return self._cond.wait_for(idle, max(0.0, deadline - time.monotonic()))


def on_pool_thread(pool: ThreadPoolExecutor | None) -> bool:
    """Whether the calling thread is one of ``pool``'s workers: a future's done-callback runs
    there, and a close() called from it can neither join the pool nor wait for a close() that
    is itself waiting for the pool."""
    return pool is not None and threading.current_thread() in getattr(pool, "_threads", ())
