"""Client side of the agent protocol over TCP: a pool of connections per agent endpoint.

Reads ``recv_into`` the caller's buffer and writes ``sendmsg`` from it: one kernel copy per hop, no
intermediate ``bytes``. Objects above ``stripe_bytes`` are split across several connections, each
served by its own agent thread, which keeps both cores busy on a loopback peer.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import socket
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mooncake_store.errors import (
    AgentBusy,
    ConnectError,
    MooncakeError,
    NoCapacity,
    ProtocolError,
    StaleLocation,
)
from mooncake_store.transport import frames
from mooncake_store.transport.cancel import current_cancel, running_under
from mooncake_store.transport.fence import Fence
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp_pool import ConnectionPool
from mooncake_store.types import footprint_bytes, parse_endpoint

SOCKET_BUFFER_BYTES = 4 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    offset: int
    alloc_id: int
    put_id: bytes = b""  # filled in by callers that keep it (spills guard their reservations by it)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadRequest:
    alloc_id: int
    offset: int
    dest: memoryview


#: A write for PeerConnections.write_pulled: (the caller's tag, alloc id, offset, bytes).
PulledWrite = tuple[Any, int, int, memoryview]


class Pull(enum.Enum):
    """What a ``take`` of PeerConnections.write_pulled may answer besides a write or None (no more
    writes): none now, while acks are still to be read (more may come once they are)."""

    LATER = "later"


#: READ requests one connection has out at once (read_many). The agent answers them in order and
#: stops reading requests while its replies do not fit the socket buffers: a client that sent
#: every request of a long train before reading a reply blocked in its send while the agent
#: blocked in its own, both until the timeout. Requests are 32 B: this many (32 KiB) fit the
#: client's send buffer many times over even where the kernel caps SOCKET_BUFFER_BYTES
#: (net.core.wmem_max, 208 KiB by default), so its send never waits for the agent to read, while
#: hundreds in flight keep both sides busy.
READ_WINDOW = 1024


class _NoDigest(ProtocolError):
    """An agent of a build without DIGEST answered it with BAD_REQUEST (and closed the connection);
    ``landed``: whether the WRITE before it landed."""

    def __init__(self, message: str, *, landed: bool = True) -> None:
        super().__init__(message)
        self.landed = landed


class PeerConnections(ConnectionPool):
    """Connections to one agent. Thread-safe: each call takes a connection of its own."""

    def __init__(self, endpoint: str, *, timeout_s: float, max_idle: int) -> None:
        super().__init__(endpoint, timeout_s=timeout_s, max_idle=max_idle)
        self._address = parse_endpoint(endpoint)
        #: The agent answered DIGEST with BAD_REQUEST (an older build): writes skip it from then on,
        #: rather than cost a connection each (the agent closes the one that asked).
        self._no_digest = False

    def _connect(self) -> socket.socket:
        """As socket.create_connection (each address of the name in turn), with each socket taken
        by the call before its connect (ConnectionPool._connect says why)."""
        host, port = self._address
        try:
            addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ConnectError(f"cannot connect to agent at {self.endpoint}: {exc}") from None
        failure: OSError | None = None
        for family, kind, proto, _, address in addresses:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:  # out of descriptors (EMFILE, ENFILE) or memory: this process's lack
                raise ConnectError(
                    f"cannot connect to agent at {self.endpoint}: no socket to be had here ({exc.strerror})"
                ) from None
            self._take(sock)
            try:
                self._connect_taken(sock, address)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
                frames.kernel_timeouts(sock, self._timeout_s)  # no poll() per chunk; MSG_WAITALL reads
                return sock
            except OSError as exc:
                self._drop(sock)
                self.raise_if_cut()
                failure = exc
            except BaseException:  # cut (raise_if_cut), or interrupted
                self._drop(sock)
                raise
        raise ConnectError(f"cannot connect to agent at {self.endpoint}: {failure or 'no address'}") from None

    def _reply(self, sock: socket.socket, op: Op) -> tuple[int, int, int, int]:
        rop, status, a, b, c = frames.unpack(self.recv_exact_within(sock, frames.HEADER_BYTES))
        if rop != op | frames.REPLY_BIT:
            raise ProtocolError(f"agent at {self.endpoint} answered op {rop} to op {int(op)}")
        if status == Status.BUSY:
            # The first reply on a connection past the agent's limit, for any op: the agent is up
            # but full, which callers treat as they treat one they cannot reach (other replicas,
            # other nodes), and an operator should read as a limit, not a crash.
            raise AgentBusy(
                f"agent at {self.endpoint} turned the connection away: it is at its connection limit "
                f"of {a} connections at once (MAX_CONNECTIONS, or fewer under its descriptor limit)"
            )
        return status, a, b, c

    # ---- control ------------------------------------------------------------------------------
    def ping(self) -> int:
        """The agent's protocol version."""
        return self.identify()[0]

    def identify(self) -> tuple[int, int]:
        """A PING's answer: (protocol version, digest of the agent's arena name: tiers.host's
        segment_digest; 0 from an agent that predates it)."""

        def run(sock: socket.socket) -> tuple[int, int]:
            frames.send_all(sock, frames.pack(Op.PING))
            _status, version, arena_digest, _ = self._reply(sock, Op.PING)
            return version, arena_digest

        version, arena_digest = self._call(run)
        return int(version), int(arena_digest)

    def reserve(
        self, requests: Sequence[tuple[int, bytes]], *, node_id: str, tier: int = 0, flags: int = 0
    ) -> list[Reservation]:
        """Reserve space for each (size, put_id). All or nothing: NoCapacity names the sizes."""

        def run_chunk(sock: socket.socket, chunk: Sequence[tuple[int, bytes]]) -> list[Reservation]:
            payload = b"".join(frames.pack_reserve_entry(size, put_id) for size, put_id in chunk)
            frames.send_all(sock, frames.pack(Op.RESERVE, len(chunk), tier, flags), memoryview(payload))
            status, a, b, c = self._reply(sock, Op.RESERVE)
            if status == Status.NO_CAPACITY:
                # As the tier counts them: a memory arena in whole units, a disk by its files.
                need = sum(size if tier == frames.TIER_DISK else footprint_bytes(size) for size, _ in chunk)
                where = frames.TIER_NAMES.get(tier, tier)
                if c == 0:  # no such tier there, or a disk tier, which takes spills only
                    raise NoCapacity(
                        f"need {need} B in {len(chunk)} object(s) on {where}; node {node_id} takes none "
                        f"there (no {where} tier, or one that takes only spills)"
                    )
                raise NoCapacity(
                    f"need {need} B in {len(chunk)} object(s) on {where}; node {node_id} has "
                    f"{a}/{c} B free, largest free block {b} B",
                    free_bytes=a,
                    largest_bytes=b,
                )
            if status != Status.OK:
                raise ProtocolError(f"agent {node_id} refused RESERVE with status {status}")
            raw = self.recv_exact_within(sock, frames.RESERVE_REPLY.size * len(chunk))
            return [Reservation(offset=off, alloc_id=alloc) for off, alloc in frames.RESERVE_REPLY.iter_unpack(raw)]

        out: list[Reservation] = []
        try:
            for start in range(0, len(requests), frames.MAX_BATCH):
                out.extend(self._call(run_chunk, requests[start : start + frames.MAX_BATCH]))
        except BaseException:
            # All or nothing across frames too: what earlier frames got goes back now, or it
            # would be held, in no caller's hands, until the agent's reservation timeout.
            if out:
                with contextlib.suppress(MooncakeError):
                    self.free([r.alloc_id for r in out])
            raise
        return out

    def free(self, alloc_ids: Sequence[int]) -> int:
        def run(sock: socket.socket, ids: Sequence[int]) -> int:
            payload = frames.pack_ids(ids)
            frames.send_all(sock, frames.pack(Op.FREE, len(ids)), memoryview(payload))
            _status, freed, _, _ = self._reply(sock, Op.FREE)
            return freed

        total = 0
        for start in range(0, len(alloc_ids), frames.MAX_BATCH):
            total += int(self._call(run, alloc_ids[start : start + frames.MAX_BATCH]))
        return total

    # ---- data ---------------------------------------------------------------------------------
    def write(self, alloc_id: int, offset: int, src: memoryview, *, digest: bool = False) -> int | None:
        """One WRITE; StaleLocation when the reservation is gone. With ``digest``, a DIGEST of the
        same range follows it on the connection before either reply is read (so it costs no round
        trip of its own), and the xxh3-64 the agent took of the bytes as they landed is returned
        (None from an agent that predates DIGEST)."""
        if not digest:
            if not self.write_many([(alloc_id, offset, src)])[0]:
                raise StaleLocation(f"agent at {self.endpoint} no longer holds reservation {alloc_id}")
            return None

        if self._no_digest:
            return self.write(alloc_id, offset, src)

        def run(sock: socket.socket) -> tuple[bool, int | None]:
            frames.send_all(sock, frames.pack(Op.WRITE, 0, alloc_id, offset, src.nbytes), src)  # what sendmsg sends
            sock.sendall(frames.pack(Op.DIGEST, 0, alloc_id, offset, src.nbytes))
            status, _, _, _ = self._reply(sock, Op.WRITE)
            if status not in (Status.OK, Status.STALE):
                raise ProtocolError(f"agent at {self.endpoint} refused WRITE with status {status}")
            if status == Status.STALE:
                # STALE as well (read to keep the stream in step), or BAD_REQUEST from an older agent
                digest_status, _, _, _ = self._reply(sock, Op.DIGEST)
                if digest_status == Status.BAD_REQUEST:
                    raise _NoDigest(f"agent at {self.endpoint} does not take DIGEST", landed=False)
                return False, None
            return True, self._digest_reply(sock, alloc_id)

        try:
            landed, checksum = self._call(run)
        except _NoDigest as exc:  # the connection was dropped; the WRITE's reply came first
            self._no_digest = True
            landed, checksum = exc.landed, None
        if not landed:
            raise StaleLocation(f"agent at {self.endpoint} no longer holds reservation {alloc_id}")
        return checksum

    def digest(self, alloc_id: int, offset: int, length: int) -> int | None:
        """The xxh3-64 of ``length`` bytes at ``offset`` of a host-tier reservation, taken by the
        agent (None from an agent that predates DIGEST); StaleLocation when the reservation is gone."""

        if self._no_digest:
            return None

        def run(sock: socket.socket) -> int:
            frames.send_all(sock, frames.pack(Op.DIGEST, 0, alloc_id, offset, length))
            return self._digest_reply(sock, alloc_id)

        try:
            result: int = self._call(run)
        except _NoDigest:
            self._no_digest = True
            return None
        return result

    def _digest_reply(self, sock: socket.socket, alloc_id: int) -> int:
        status, checksum, _, _ = self._reply(sock, Op.DIGEST)
        if status == Status.BAD_REQUEST:
            # An agent older than the op answers so and closes the connection. Raised, so that
            # _call drops the connection rather than pool it for the next call, which would find
            # it reset (a pooled connection's close may not be seen yet when it is taken again).
            raise _NoDigest(f"agent at {self.endpoint} does not take DIGEST")
        if status == Status.STALE:
            raise StaleLocation(f"agent at {self.endpoint} no longer holds reservation {alloc_id}")
        if status != Status.OK:
            raise ProtocolError(f"agent at {self.endpoint} refused DIGEST with status {status}")
        return checksum

    def write_many(self, requests: Sequence[tuple[int, int, memoryview]], *, window: int = 4) -> list[bool]:
        """Pipelined writes on one connection, each (alloc_id, offset, bytes): up to ``window``
        WRITE frames go out before their acks are read, so one write's ack overlaps the next one's
        bytes. Returns per write whether it landed (False: STALE)."""
        pending = iter(enumerate(requests))

        def take(_wait: bool) -> PulledWrite | None:
            item = next(pending, None)
            return None if item is None else (item[0], *item[1])

        return [landed for _, landed in self.write_pulled(take, window=window)]

    def write_pulled(
        self,
        take: Callable[[bool], PulledWrite | Pull | None],
        *,
        window: int = 4,
        acked: Callable[[Any, bool], None] | None = None,
    ) -> list[tuple[Any, bool]]:
        """Pipelined writes on one connection, each (tag, alloc_id, offset, bytes) taken from
        ``take`` whenever this connection has room in its window (``window`` WRITE frames out before
        their acks are read), until ``take`` returns None. Connections that share one ``take``
        share the work as each keeps up, not in equal parts: none waits at the end for a slower one
        that was dealt as much. ``take(wait)`` is asked with ``wait`` False while writes are out:
        it may then answer Pull.LATER (nothing now), and the next ack is read; with nothing out it
        may block until it has a write or None (agent/spill_writes.py rolls from one batch into
        the next so). The agent serves a connection in order and drains a refused write before it
        answers, so the acks come back in order; each is told to ``acked(tag, landed)`` as it comes.
        Returns (tag, landed) per write sent, in order (landed False: STALE, the reservation went)."""

        def run(sock: socket.socket) -> list[tuple[Any, bool]]:
            out: list[tuple[Any, bool]] = []
            in_flight: collections.deque[Any] = collections.deque()
            more = True
            while True:
                while more and len(in_flight) < max(1, window):
                    request = take(not in_flight)
                    if request is Pull.LATER:
                        break
                    if request is None:
                        more = False
                        break
                    tag, alloc_id, offset, src = request
                    frames.send_all(sock, frames.pack(Op.WRITE, 0, alloc_id, offset, src.nbytes), src)
                    in_flight.append(tag)
                if not in_flight:
                    if more:
                        continue  # a take that waits answered LATER: ask again
                    return out
                status, _, _, _ = self._reply(sock, Op.WRITE)
                if status not in (Status.OK, Status.STALE):
                    raise ProtocolError(f"agent at {self.endpoint} refused WRITE with status {status}")
                tag = in_flight.popleft()
                out.append((tag, status == Status.OK))
                if acked is not None:
                    acked(tag, status == Status.OK)

        return list(self._call(run))

    def fenced(
        self, alloc_ids: Sequence[int], shm_name: str, copy: Callable[[list[bool]], list[bool]]
    ) -> list[bool] | None:
        """Copy into host-tier reservations of a same-host agent's shared arena under its fence:
        FENCE them, run ``copy(fenced)`` (which copies into the fenced ones and says per id whether
        it did), then UNFENCE, all on one connection (see Fence). Returns per id whether the bytes
        landed in a reservation the agent still holds: fenced, copied, and not freed meanwhile;
        None, with nothing copied, when the agent's arena is not the segment ``shm_name`` the caller
        maps. Should the connection break, the agent lifts the fences when it closes."""
        fence = Fence(self, alloc_ids, shm_name)
        try:
            fenced = fence.fenced()
            done = copy(fenced) if fenced is not None else None
            fence.unfence()
            still = fence.finish()
        except BaseException:
            fence.abort()  # the work's own error is the one reported; the close lifts the fences
            raise
        if fenced is None or done is None:
            return None
        return [f and d and still.get(x, False) for x, f, d in zip(fence.ids, fenced, done, strict=True)]

    def _stale_read(self, alloc_id: int, *, why: int, held: int, budget: int) -> StaleLocation:
        if why == frames.STALE_READS_HELD:
            return StaleLocation(
                f"agent at {self.endpoint} did not serve allocation {alloc_id}: it holds {held} B of objects "
                f"decoded or copied out for READs, its budget is {budget} B, and none was let go while the READ "
                "waited (try again, or read fewer disk or GPU objects at once)"
            )
        if why == frames.STALE_UNREADABLE:
            return StaleLocation(
                f"agent at {self.endpoint} holds allocation {alloc_id} but could not read its file now (out of "
                "memory or file descriptors, or permissions changed under it: its log names the reason); the file "
                "is kept"
            )
        return StaleLocation(f"agent at {self.endpoint} no longer holds allocation {alloc_id}")

    def read_many(self, requests: Sequence[ReadRequest], *, window: int = READ_WINDOW) -> None:
        """Pipelined reads on one connection: up to ``window`` requests are out at once and the
        replies land in order, each straight into its destination. Requests go out in batches of
        half the window (one send each) as the replies of the previous half come in."""

        def run(sock: socket.socket) -> None:
            most = max(1, window)
            sent = 0
            stale: StaleLocation | None = None
            for done, r in enumerate(requests):
                if sent - done <= most // 2 and sent < len(requests):
                    batch = requests[sent : done + most]
                    sock.sendall(b"".join(frames.pack(Op.READ, 0, x.alloc_id, x.offset, len(x.dest)) for x in batch))
                    sent += len(batch)
                status, a, b, length = self._reply(sock, Op.READ)
                if status == Status.STALE:
                    stale = self._stale_read(r.alloc_id, why=a, held=b, budget=length)  # c: the budget here
                    continue
                if status != Status.OK or length != len(r.dest):
                    raise ProtocolError(f"agent at {self.endpoint} answered READ with status {status}, {length} B")
                self.recv_within(sock, r.dest)
            if stale is not None:
                raise stale

        self._call(run)


class TcpTransport:
    """Pools per endpoint, plus the threads that carry the stripes of large objects."""

    def __init__(self, *, timeout_s: float, connections_per_peer: int, stripe_bytes: int) -> None:
        self._timeout_s = timeout_s
        self._connections = connections_per_peer
        self._stripe_bytes = stripe_bytes
        self._peers: dict[str, PeerConnections] = {}
        #: Every pool made, dropped ones included while a call still uses one: close() cuts them all.
        self._made: weakref.WeakSet[PeerConnections] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._stripes = ThreadPoolExecutor(max_workers=max(1, connections_per_peer), thread_name_prefix="mc-stripe")
        self._closed = False

    def peer(self, endpoint: str) -> PeerConnections:
        with self._lock:
            if self._closed:
                raise MooncakeError(f"TCP transport is closed (asked for {endpoint})")
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = PeerConnections(endpoint, timeout_s=self._timeout_s, max_idle=self._connections * 2)
                self._peers[endpoint] = peer
                self._made.add(peer)
            return peer

    @property
    def pooled(self) -> bool:
        """Whether any endpoint has a pool (then the node table is worth a look now and then)."""
        return bool(self._peers)

    def retain(self, endpoints: set[str]) -> None:
        """Given the node table's endpoints: close the pools of the others. An agent that stopped,
        died and was reaped, or came back on another port kept its pooled connections open (half
        closed) for the life of this process, up to ``2 x connections_per_peer`` each. Calls under
        way finish on their own connections."""
        with self._lock:
            gone = [self._peers.pop(endpoint) for endpoint in list(self._peers) if endpoint not in endpoints]
        for peer in gone:
            peer.close()

    def drop_peer_after(self, endpoint: str, exc: MooncakeError) -> None:
        """After a call to ``endpoint`` failed with ``exc``: drop its pool if the failure says the
        agent may be gone (a refused or broken connection), so no call reuses a dead connection.
        Not for AgentBusy: the agent is up and its connections healthy, and closing them all (the
        other threads' too, as they come back) only had them all reconnect to an agent at its
        connection limit, each reconnect another accept and possibly another refusal."""
        if isinstance(exc, ConnectError) and not isinstance(exc, AgentBusy):
            self.drop_peer(endpoint)

    def drop_peer(self, endpoint: str) -> None:
        with self._lock:
            peer = self._peers.pop(endpoint, None)
        if peer is not None:
            peer.close()

    def close(self) -> None:
        """Close every connection: pooled ones, and those of transfers under way, which fail at
        once (TransferError) rather than wait on their agent up to timeout_s. A transfer started
        later ends with MooncakeError instead of opening new ones."""
        with self._lock:
            self._closed = True
            # Listed before the pool lets them go: _made holds them weakly, and a peer only the
            # pool held was collected in between, its sockets left to the garbage collector
            # (ResourceWarning: unclosed socket) instead of closed here.
            peers = [*self._peers.values(), *self._made]
            self._peers = {}
        for peer in peers:
            peer.abort()
        self._stripes.shutdown(wait=False, cancel_futures=True)

    def _stripes_of(self, length: int) -> list[tuple[int, int]]:
        if length <= self._stripe_bytes or self._connections == 1:
            return [(0, length)]
        count = min(self._connections, -(-length // self._stripe_bytes))
        step = -(-length // count)
        step = -(-step // 4096) * 4096  # page-aligned stripes keep the copies aligned
        return [(start, min(step, length - start)) for start in range(0, length, step)]

    def read_into(self, endpoint: str, alloc_id: int, offset: int, dest: memoryview) -> None:
        peer = self.peer(endpoint)
        self._fan_out(
            len(dest),
            lambda s, n: peer.read_many([ReadRequest(alloc_id=alloc_id, offset=offset + s, dest=dest[s : s + n])]),
        )

    def write_from(
        self, endpoint: str, alloc_id: int, offset: int, src: memoryview, *, digest: bool = False
    ) -> int | None:
        """Write ``src`` into a reservation. With ``digest``, returns the xxh3-64 the agent took of
        the bytes as they landed (None from an agent that predates DIGEST): behind the WRITE on its
        connection for an object of one stripe, after every stripe landed for a striped one (one
        round trip more, small next to several stripes' bytes)."""
        peer = self.peer(endpoint)
        if len(self._stripes_of(len(src))) == 1:
            return peer.write(alloc_id, offset, src, digest=digest)
        self._fan_out(len(src), lambda s, n: peer.write(alloc_id, offset + s, src[s : s + n]))
        return peer.digest(alloc_id, offset, len(src)) if digest else None

    def _fan_out(self, length: int, transfer: Callable[[int, int], None]) -> None:
        """Run ``transfer(start, length)`` per stripe: the first on this thread, the rest on the
        stripe pool (each on a connection of its own); the first error is raised once all settle.

        The pool is shared by every peer and thread: a stripe still queued when this thread is
        done with its own is taken back and run here, so a transfer to a healthy agent does not
        wait behind other threads' stripes to a stalled one (up to timeout_s each)."""
        stripes = self._stripes_of(length)
        closed = MooncakeError("TCP transport is closed")
        futures: list[Future[None]] = []
        first_error: BaseException | None = None
        cancel = current_cancel()

        def stripe(s: int, n: int) -> None:
            with running_under(cancel):  # the caller's Cancel cuts its stripes' connections too
                transfer(s, n)

        here: list[tuple[int, int]] = []  # stripes no pool thread will take: run on this thread
        try:
            for s, n in stripes[1:]:
                futures.append(self._stripes.submit(stripe, s, n))
        except RuntimeError:
            if self._closed:  # the pool was shut down: close() ran meanwhile
                first_error = closed
            else:
                # The interpreter is exiting: once the main thread returned, concurrent.futures
                # takes no new work, and every striped transfer of threads still running (and of
                # queued *_async calls) failed as "TCP transport is closed", the client open.
                here = stripes[1 + len(futures) :]
        for s, n in [stripes[0], *here] if first_error is None else []:
            try:
                transfer(s, n)
            except BaseException as exc:
                first_error = exc
                break
        for (s, n), fut in zip(stripes[1:], futures, strict=False):
            if not fut.cancelled() and fut.cancel():  # still queued: no worker was free for it
                if first_error is None:
                    try:
                        transfer(s, n)
                    except BaseException as exc:
                        first_error = exc
                continue
            try:
                exc = fut.exception()
            except CancelledError:  # close() cancelled it before a stripe thread took it
                exc = closed
            first_error = first_error or exc
        if first_error is not None:
            raise first_error
