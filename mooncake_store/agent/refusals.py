"""Connections past the agent's connection limit, turned away politely on the accept thread.

A connection over the limit gets no thread: its first request header is read, answered BUSY with
the limit (in the request's op), and the connection is closed once its client has closed its end
or the time is up. All of it runs on the accept thread's poll, without blocking it, so a refusal
never holds up accept() for the next connection.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time

from mooncake_store.errors import ProtocolError
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Status

#: A connection past the limit has this long to send its first request header, which is answered
#: BUSY with the limit; a client sends it right after connecting.
REFUSE_WAIT_S = 1.0
#: ... and then this long to read the reply and close, plus a WRITE's length at the slowest rate a
#: served request may go (the server's MIN_RATE_BPS). What it sends meanwhile (the WRITE's payload,
#: which a client sends whole before it reads a reply) is read and dropped: closed with unread
#: bytes, the connection would be reset, and a client still sending would see the reset instead
#: of the reply.
REFUSE_LINGER_S = 1.0
#: The most of a refused WRITE's payload that is waited for and drained (its declared length is the
#: client's word): a client trickling bytes of a WRITE that claims 2**63 B would otherwise hold its
#: refusal, one of MAX_REFUSALS, for good. A stripe of a put is 4 MiB by default.
REFUSE_DRAIN_MAX_BYTES = 64 << 20
#: Connections turned away at once (each holds a descriptor beyond the limit, out of FD_RESERVE);
#: more are closed without a reply.
MAX_REFUSALS = 16


class Refusals:
    """The connections being turned away, registered on the accept loop's ``poller``."""

    def __init__(self, poller: select.poll, limit: int, *, min_rate_bps: float, idle_s: float) -> None:
        self._poller = poller
        self._limit = limit
        self._min_rate_bps = min_rate_bps
        self._idle_s = idle_s
        self._by_fd: dict[int, _Refusal] = {}

    def add(self, conn: socket.socket) -> None:
        """Turn ``conn`` away with a BUSY reply naming the limit, so that its client is told the
        agent is full instead of seeing a reset."""
        if len(self._by_fd) >= MAX_REFUSALS:
            conn.close()  # a flood of them: the descriptors matter more than the courtesy
            return
        # Made before its descriptor is registered: a registration left behind by a failure
        # would have poll() report the closed descriptor at every turn.
        refusal = _Refusal(conn, self._limit, self._min_rate_bps, self._idle_s)
        try:
            conn.setblocking(False)
            fd = conn.fileno()
            self._poller.register(fd, select.POLLIN)
        except OSError:
            conn.close()
            return
        self._by_fd[fd] = refusal

    def wait_s(self, longest: float) -> float:
        """How long the poll may wait: ``longest``, or less when a refusal is due sooner."""
        if not self._by_fd:
            return longest
        soonest = min(r.deadline for r in self._by_fd.values())
        return min(longest, max(0.0, soonest - time.monotonic()))

    def step(self, fd: int) -> None:
        """Serve a refused connection that poll() said is ready (nothing for another fd)."""
        refusal = self._by_fd.get(fd)
        if refusal is not None and not refusal.step():
            self.end(fd)

    def expire(self) -> None:
        """Close the refused connections whose time is up."""
        now = time.monotonic()
        for fd in [fd for fd, r in self._by_fd.items() if r.deadline <= now]:
            self.end(fd)

    def close(self) -> None:
        for fd in list(self._by_fd):
            self.end(fd)

    def end(self, fd: int) -> None:
        """Stop turning ``fd``'s connection away and close it."""
        with contextlib.suppress(KeyError, OSError):
            self._poller.unregister(fd)  # before the close: the number may be reused at once
        refusal = self._by_fd.pop(fd, None)
        if refusal is not None:
            refusal.sock.close()


class _Refusal:
    """A connection past the limit, served on the accept thread's poll without blocking: its first
    request header is read, answered BUSY (a = the limit) in the request's op, and the connection
    is closed once the client has closed its end or the time is up (REFUSE_WAIT_S, then
    REFUSE_LINGER_S and the WRITE's length at ``min_rate_bps``, and never longer than ``idle_s``
    after the client last sent a byte: a header may declare any length, and one that declares a
    terabyte and sends nothing must not hold a refusal for days). A stream that is not ours gets
    no reply, as in _serve."""

    __slots__ = ("header", "idle_s", "last_seen", "limit", "linger_until", "min_rate_bps", "replied", "sock")

    #: What a refused client sends after its header (a WRITE's payload), read and dropped. Only
    #: the accept thread uses it.
    _sink = memoryview(bytearray(64 << 10))

    def __init__(self, sock: socket.socket, limit: int, min_rate_bps: float, idle_s: float) -> None:
        self.sock = sock
        self.limit = limit
        self.min_rate_bps = min_rate_bps
        self.idle_s = idle_s
        self.header = bytearray()
        self.linger_until = time.monotonic() + REFUSE_WAIT_S
        self.last_seen = time.monotonic()
        self.replied = False

    @property
    def deadline(self) -> float:
        """When to close it: the end of its linger, or ``idle_s`` after its last byte if sooner."""
        return min(self.linger_until, self.last_seen + self.idle_s)

    def step(self) -> bool:
        """Serve what poll() said is ready; False when the connection is done with (close it)."""
        try:
            if self.replied:
                self.last_seen = time.monotonic()
                return self.sock.recv_into(self._sink) > 0  # 0: the client closed its end
            chunk = self.sock.recv(frames.HEADER_BYTES - len(self.header))
            if not chunk:
                return False
            self.header += chunk
            if len(self.header) < frames.HEADER_BYTES:
                return True
            if self.header[: len(frames.MAGIC)] != frames.MAGIC:
                return False
            op = self.header[len(frames.MAGIC) + 1]
            payload = 0
            if op == frames.Op.WRITE:
                try:
                    payload = frames.unpack(bytes(self.header))[4]
                except ProtocolError:
                    pass  # another version's frame: the reply names the limit, the drain stays short
            # 32 bytes into the empty send buffer of a new connection: never short.
            self.sock.send(frames.pack(op | frames.REPLY_BIT, Status.BUSY, self.limit))
            self.sock.shutdown(socket.SHUT_WR)
        except BlockingIOError:
            return True  # woken for nothing after all
        except OSError:
            return False
        self.replied = True
        self.last_seen = time.monotonic()
        self.linger_until = self.last_seen + REFUSE_LINGER_S + min(payload, REFUSE_DRAIN_MAX_BYTES) / self.min_rate_bps
        return True
