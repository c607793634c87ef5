"""Cutting transfers short from another thread: a Cancel shuts down the connections of the
operations that run under it, so that one waiting on a stalled agent fails at once instead of at
timeout_s. The TCP transport (tcp.py) registers each connection a call takes with the Cancel the
calling thread runs under; a client's close() cuts every connection of its transport the same way.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from mooncake_store.errors import MooncakeError


def shut_down(sock: socket.socket) -> None:
    """Shut down both directions of a connection another thread may be waiting on: its recv sees
    the end of the stream and its send a broken pipe at once, whatever the peer does. The owner
    still closes it (closing it from here could let the descriptor be reused under its call)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Cancel:
    """Lets operations be cut short from another thread. The connections that operations run
    under it take (``with cancel.active():`` in the thread that runs one; a striped transfer
    carries it to its stripe threads) are shut down by :meth:`cancel`, so a transfer waiting on a
    stalled agent fails at once instead of at timeout_s, and later ones are refused with
    ``MooncakeError(message)``. A PrefixCache cuts its operations in flight this way when it is
    closed while its client stays open."""

    def __init__(self, message: str) -> None:
        self.message = message
        self._lock = threading.Lock()
        self._held: set[socket.socket] = set()
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with running_under(self):
            yield

    def cancel(self) -> None:
        # Under the lock: a holder lets go of a connection (under it) before it closes it, so no
        # descriptor is shut down after its close.
        with self._lock:
            self._cancelled = True
            for sock in self._held:
                shut_down(sock)

    def hold(self, sock: socket.socket) -> None:
        with self._lock:
            if self._cancelled:
                raise MooncakeError(self.message)
            self._held.add(sock)

    def let_go(self, sock: socket.socket) -> None:
        with self._lock:
            self._held.discard(sock)


_current = threading.local()


def current_cancel() -> Cancel | None:
    """The Cancel the calling thread runs under, if any."""
    cancel: Cancel | None = getattr(_current, "cancel", None)
    return cancel


@contextlib.contextmanager
def running_under(cancel: Cancel | None) -> Iterator[None]:
    outer = current_cancel()
    _current.cancel = cancel
    try:
        yield
    finally:
        _current.cancel = outer
