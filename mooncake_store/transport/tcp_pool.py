"""The connection pool under PeerConnections (transport/tcp.py): idle connections kept for reuse
and retired before the agent closes them, and the connections of calls under way, which abort()
and a Cancel can cut. The protocol's operations are PeerConnections'; opening a connection too."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
import weakref

from mooncake_store.errors import MooncakeError, ProtocolError, TransferError, TransferTimeout
from mooncake_store.transport import frames
from mooncake_store.transport.cancel import Cancel, current_cancel, shut_down

#: Pooled connections idle longer than this are not reused (the agent closes them after its own,
#: longer, limit: agent/server.py IDLE_CLOSE_S).
POOL_IDLE_S = 300.0
#: A connect under way looks this often (s) whether its transport was closed or its call cancelled
#: just before it began.
CUT_CHECK_S = 0.05


def _readable(sock: socket.socket) -> bool:
    """An idle pooled connection with something to read has been closed or reset by the agent (a
    reply is never pending between requests)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


#: Every pool of this process: a forked child closes its copies of their connections.
_POOLS: weakref.WeakSet[ConnectionPool] = weakref.WeakSet()


class ConnectionPool:
    """Connections to one endpoint, each used by one call at a time. ``_connect`` opens one."""

    def __init__(self, endpoint: str, *, timeout_s: float, max_idle: int) -> None:
        self.endpoint = endpoint
        self._timeout_s = timeout_s
        self._max_idle = max_idle
        self._idle: list[tuple[socket.socket, float]] = []  # (connection, when it went idle), newest last
        #: Connections taken by calls under way, with the Cancel each call runs under: abort() and
        #: Cancel.cancel() shut them down.
        self._busy: dict[socket.socket, Cancel | None] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._aborted = False
        _POOLS.add(self)

    def _connect(self) -> socket.socket:
        """A new connection, taken by the calling call (:meth:`_take`) from before its connect, so
        that abort() or a Cancel cuts a connect under way too: to an agent whose host went dark it
        would otherwise wait out timeout_s, and a client's close() with it."""
        raise NotImplementedError

    def _acquire(self) -> socket.socket:
        """A pooled connection that is still good, else a new one. Connections idle longer than
        POOL_IDLE_S are retired before the agent closes them (AgentServer closes idle ones after
        IDLE_CLOSE_S); one the agent closed or reset anyway shows as readable, and is dropped."""
        stale: list[socket.socket] = []
        sock: socket.socket | None = None
        now = time.monotonic()
        with self._lock:
            while self._idle:
                candidate, since = self._idle.pop()
                if now - since > POOL_IDLE_S or _readable(candidate):
                    stale.append(candidate)
                    continue
                sock = candidate
                break
        for dead in stale:
            dead.close()
        if sock is None:
            return self._connect()  # taken already
        self._take(sock)
        return sock

    def _take(self, sock: socket.socket) -> None:
        """Count ``sock`` as in use by the calling thread's call (and its Cancel), so that abort()
        or a cancel() can cut it; refused (closed, MooncakeError) once either has run."""
        cancel = current_cancel()
        with self._lock:
            refused = self._aborted
            if not refused:
                self._busy[sock] = cancel
        if refused:
            sock.close()
            raise self._closed_error()
        if cancel is not None:
            try:
                cancel.hold(sock)
            except BaseException:
                self._drop(sock)
                raise

    def _closed_error(self) -> MooncakeError:
        return MooncakeError(f"TCP transport is closed (asked for {self.endpoint})")

    def raise_if_cut(self) -> None:
        """Raise what the call's failure really was when abort() or its Cancel cut it (a connect
        cut short fails as a reset, which is no news about the agent)."""
        cancel = current_cancel()
        if cancel is not None and cancel.cancelled:
            raise MooncakeError(cancel.message)
        if self._aborted:
            raise self._closed_error()

    def _connect_taken(self, sock: socket.socket, address: object) -> None:
        """Connect ``sock``, taken already, within timeout_s; raises OSError (socket.timeout when it
        ran out). Non-blocking, in slices of CUT_CHECK_S: abort() or a Cancel shuts a connect under
        way down at once, and one they ran just before it began (a shutdown before a connect does
        not stop the connect) is seen at the next slice."""
        sock.setblocking(False)
        code = sock.connect_ex(address)  # type: ignore[arg-type]
        if code not in (0, errno.EINPROGRESS):
            raise OSError(code, os.strerror(code))
        deadline = time.monotonic() + self._timeout_s
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        while code == errno.EINPROGRESS:
            self.raise_if_cut()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            if poller.poll(1000 * min(left, CUT_CHECK_S)):
                self.raise_if_cut()  # a connect shut down is no answer from the agent
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, os.strerror(code))
        sock.setblocking(True)

    def _untake(self, sock: socket.socket) -> None:
        with self._lock:
            cancel = self._busy.pop(sock, None)
        if cancel is not None:
            cancel.let_go(sock)

    def _drop(self, sock: socket.socket) -> None:
        """Close a connection taken by a call (its stream may be mid-frame)."""
        self._untake(sock)
        sock.close()

    def _release(self, sock: socket.socket) -> None:
        self._untake(sock)
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()

    def close(self) -> None:
        """Close the idle connections and pool no more; calls under way finish on theirs."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    def abort(self) -> None:
        """close(), and also cut the connections of calls under way (they fail at once, with
        TransferError) and refuse new ones: what a client's close() does to its transfers."""
        with self._lock:
            self._aborted = True
            for sock in self._busy:
                shut_down(sock)  # under the lock: a call lets go of it (under it) before closing it
        self.close()

    def _forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the parent's connections (the parent's
        stay open) and pool no more. Kept, a child that lived on held a connection the parent
        then used, and the agent never saw it close when the parent died: a fence taken on it
        held its reservation for as long as the child lived (a probe: 5 of 6 trials)."""
        self._lock = threading.Lock()  # a parent thread may have held it at the fork
        socks = [sock for sock, _ in self._idle] + list(self._busy)
        self._idle, self._busy = [], {}
        self._closed = self._aborted = True
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()  # close(2) of this copy only: shutdown(2) would cut the parent's too

    def recv_within(self, sock: socket.socket, view: memoryview) -> None:
        """Fill ``view`` from a reply, bounded as a whole by timeout_s + its length at
        frames.MIN_RATE_BPS: SO_RCVTIMEO bounds each recv only, so an agent trickling a byte per
        timeout held the caller (a read, a spill's pressure pass) for as many timeouts."""
        allowed_s = self._timeout_s + len(view) / frames.MIN_RATE_BPS
        try:
            frames.recv_into_by(sock, view, time.monotonic() + allowed_s, self._timeout_s)
        except TransferTimeout as exc:
            raise TransferTimeout(
                f"agent at {self.endpoint}: reply {exc}; {allowed_s:.2f} s allowed (timeout_s {self._timeout_s:g} s, "
                f"and {len(view)} B at {frames.MIN_RATE_BPS / (1 << 20):g} MiB/s)"
            ) from None

    def recv_exact_within(self, sock: socket.socket, n: int) -> bytearray:
        buf = bytearray(n)
        self.recv_within(sock, memoryview(buf))
        return buf

    def _call(self, func, *args):  # type: ignore[no-untyped-def]
        """Run ``func(sock, *args)`` on a pooled connection; a connection that saw an error is dropped,
        since the stream may be mid-frame."""
        sock = self._acquire()
        result = self._on(sock, func, *args)
        self._release(sock)
        return result

    def _on(self, sock: socket.socket, func, *args):  # type: ignore[no-untyped-def]
        """``func(sock, *args)`` on a connection already taken; on any error the connection is closed
        (the stream may be mid-frame) and socket errors become TransferError."""
        try:
            return func(sock, *args)
        except (OSError, TransferError, ProtocolError) as exc:
            self._drop(sock)
            if isinstance(exc, TransferError | ProtocolError):
                raise
            if isinstance(exc, BlockingIOError):  # SO_RCVTIMEO / SO_SNDTIMEO ran out
                raise TransferTimeout(
                    f"agent at {self.endpoint} made no progress for {self._timeout_s:g} s (timeout_s)"
                ) from None
            raise TransferError(f"transfer with agent at {self.endpoint} failed: {exc}") from None
        except BaseException:
            self._drop(sock)
            raise


def _close_inherited_connections() -> None:
    for pool in list(_POOLS):
        pool._forget_in_child()


os.register_at_fork(after_in_child=_close_inherited_connections)
