"""The agent's TCP server: the control ops (reserve, free, fence, unfence) and the data ops (read,
write, digest).

One thread per connection: the socket calls release the GIL, and clients keep a handful of
connections per agent. Every frame is checked before a byte of payload is read; a malformed
frame closes that connection only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
import threading
import time
from typing import Any, Protocol

import xxhash

from mooncake_store.agent.allocations import AllocationTable
from mooncake_store.agent.refusals import Refusals
from mooncake_store.config import split_host_port
from mooncake_store.errors import ConnectError, MooncakeError, ProtocolError, TransferError, TransferTimeout
from mooncake_store.tiers.disk import HEADER as DISK_HEADER
from mooncake_store.tiers.host import HostArena, segment_digest
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import SOCKET_BUFFER_BYTES

log = logging.getLogger("mooncake.agent")

#: RESERVE tiers (header field a).
TIER_HOST = 0
TIER_GPU = 1
#: Spills from a peer's disk tier only: each reservation receives one whole chunk file.
TIER_DISK = 2
#: RESERVE flag: the reservation is a spill from a peer agent.
SPILL_FLAG = 1
#: Pause before accepting again after accept() failed (out of descriptors, say).
ACCEPT_RETRY_S = 0.1
#: Longest wait of the accept loop's poll: how soon it sees stop().
ACCEPT_POLL_S = 0.5
#: Connections taken from the backlog per wake of the accept loop, before it looks at the
#: connections it is turning away again.
ACCEPT_BATCH = 64
#: Connections served at once (one thread each); more are turned away as they arrive (BUSY, then
#: the close). Fewer where the process may not open that many descriptors (connection_limit).
MAX_CONNECTIONS = 4096
#: Descriptors left out of the connection limit: the arena, chunk files, Redis connections, logs.
FD_RESERVE = 64
#: A connection idle this long is closed (clients retire pooled ones sooner: tcp.POOL_IDLE_S).
IDLE_CLOSE_S = 600.0
#: Chunk for draining the payload of a refused WRITE.
DRAIN_BYTES = 1 << 20
#: The slowest a request's bytes may arrive (and a READ's reply leave), beyond the first
#: timeout_s: a request must be done by timeout_s + its length / MIN_RATE_BPS from its header's
#: first byte. timeout_s bounds each recv and send only, so a peer sending a byte per timeout
#: would hold a WRITE's reservation (or a READ's allocation) and a thread for ever. 1 MiB/s is
#: about a thousandth of a 10 Gb/s link, far below what even a writer sharing one with dozens of
#: streams gets, and still cuts a trickled 1 GiB WRITE off within 18 minutes.
MIN_RATE_BPS = 1 << 20


def connection_limit() -> int:
    """MAX_CONNECTIONS, or fewer where the descriptor limit is lower: past it accept() fails, and a
    new connection would wait in the listen backlog, neither served nor turned away, until its
    client timed out. The soft limit is raised to the hard one first (as far as MAX_CONNECTIONS
    needs): the common soft limit of 1024 is a default, not a decision."""
    try:
        import resource  # POSIX only
    except ImportError:
        return MAX_CONNECTIONS
    wanted = MAX_CONNECTIONS + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if raised > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
            except (ValueError, OSError) as exc:
                log.info("cannot raise the descriptor limit from %d to %d: %s", soft, raised, exc)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft - FD_RESERVE))


class AgentHooks(Protocol):
    """What the server asks of the agent beyond the host arena."""

    def read_other_tier(self, alloc_id: int) -> tuple[bytearray, int] | None:
        """The whole object of an alloc id that lives in another tier (GPU, disk) and the offset
        its first byte has in READ's terms (its place in the GPU arena; 0 on disk), or None."""

    def after_other_tier_read(self, alloc_id: int, data: bytearray) -> None:
        """Called once the reply is sent (promotion happens here)."""

    def host_read(self, length: int) -> None:
        """A READ of the host arena is being served (counted with the host tier's activity)."""

    def reserve_other_tier(self, tier: int, requests: list[tuple[int, bytes]], *, spill: bool) -> list[Any] | None:
        """Reservations in tier ``tier`` (1: GPU, 2: disk, for spills only); None when the agent has
        no room or no such tier."""

    def other_tier_room(self, tier: int, *, spill: bool) -> tuple[int, int, int]:
        """(free bytes, largest free block, capacity) of tier ``tier`` here, for a refusal's reply
        (zeros when there is no such tier, or it takes no such reservation)."""

    def other_tier_staging(self, alloc_id: int, offset: int, length: int) -> bytearray | None:
        """A host buffer to receive a WRITE into an allocation of another tier (which is fenced
        against frees until other_tier_written), or None."""

    def other_tier_written(self, alloc_id: int, offset: int, data: bytearray | None) -> bool:
        """Move a received WRITE (None: it broke off) into the other tier and lift the fence;
        False when the reservation was freed meanwhile (the write is void)."""

    def reserved(self) -> None:
        """A reservation was granted (the agent checks its watermark: relief starts early)."""

    def reclaim_now(self) -> None:
        """Free what is already due (graveyard entries past their lease, abandoned reservations)."""

    def no_room(self, size_bytes: int) -> None:
        """A reservation did not fit even after reclaim_now."""

    def spill_reserved(self, alloc_ids: list[int], tier: int) -> None:
        """Reservations flagged as spills from a peer were granted in ``tier`` (counted as spills
        in once their swaps land)."""

    def expire_other_tiers(self, alloc_ids: list[int]) -> int:
        """A FREE's share outside the host arena: reservations in other tiers that expire now."""


class AgentServer:
    def __init__(
        self, listen: str, arena: HostArena, table: AllocationTable, *, timeout_s: float, hooks: AgentHooks
    ) -> None:
        host, port = split_host_port(listen, what="agent.listen")  # brackets of "[::1]:0" removed
        self._arena = arena
        self._table = table
        self._timeout_s = timeout_s
        self._hooks = hooks
        # create_server() defaults to AF_INET, which cannot bind an IPv6 address.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=256, reuse_port=False)
        except OSError as exc:
            raise ConnectError(f"agent cannot listen on {listen}: {exc}") from None
        # The accept loop polls it with the connections it turns away (_accept_loop).
        self._sock.setblocking(False)
        bound_port = self._sock.getsockname()[1]
        # Bracketed, an IPv6 endpoint still splits at its last colon (parse_endpoint strips them).
        self.endpoint = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self.max_connections = connection_limit()
        self._full_logged_at = 0.0
        #: FENCEd alloc ids per connection (only its own thread touches its set).
        self._fences: dict[socket.socket, set[int]] = {}
        self._lock = threading.Lock()
        self._accept_thread = threading.Thread(target=self._accept_loop, name="mc-accept", daemon=True)
        self.counters = {"reads": 0, "writes": 0, "read_bytes": 0, "write_bytes": 0}

    def start(self) -> None:
        self._accept_thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._accept_thread.join(timeout=2)
        for thread in list(self._threads):
            thread.join(timeout=2)

    def _accept_loop(self) -> None:
        # One poll over the listening socket and the connections being turned away: a refusal
        # (waiting for the request, answering BUSY, reading what follows) never holds up accept()
        # for the next connection, and costs no thread.
        poller = select.poll()
        listen_fd = self._sock.fileno()
        poller.register(listen_fd, select.POLLIN)
        # A refused writer may pause between bytes as long as a served one may (one recv's timeout).
        refusals = Refusals(poller, self.max_connections, min_rate_bps=MIN_RATE_BPS, idle_s=self._timeout_s)
        try:
            while not self._stop.is_set():
                for fd, _events in poller.poll(math.ceil(refusals.wait_s(ACCEPT_POLL_S) * 1000)):
                    if fd == listen_fd:
                        if not self._accept_ready(refusals):
                            return
                    else:
                        refusals.step(fd)
                refusals.expire()
        finally:
            refusals.close()

    def _accept_ready(self, refusals: Refusals) -> bool:
        """Take what the backlog holds (ACCEPT_BATCH at most); False once stop() ran."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return True  # the backlog is empty
            except OSError as exc:
                if self._stop.is_set():
                    return False  # stop() shut the listening socket down
                # Out of descriptors (EMFILE, ENFILE) or memory is a passing condition: serving
                # nobody ever again would be the worse outcome.
                log.warning("accept failed: %s; retrying", exc)
                self._stop.wait(ACCEPT_RETRY_S)
                return True
            self._admit(conn, refusals)
        return True

    def _admit(self, conn: socket.socket, refusals: Refusals) -> None:
        with self._lock:
            full = len(self._conns) >= self.max_connections
        if full:
            # One thread per connection: a client that opens connections without end must not
            # exhaust the agent's threads and descriptors. Pools hold a few per peer.
            if time.monotonic() - self._full_logged_at > 1.0:  # once a second, not per connection
                self._full_logged_at = time.monotonic()
                log.warning("%d connections open, the limit; turning new ones away", self.max_connections)
            refusals.add(conn)
            return
        try:
            # A request under way must go on promptly (each recv and send is bounded, and the
            # request as a whole: MIN_RATE_BPS); idle pooled connections wait for their next
            # request in poll(), up to IDLE_CLOSE_S.
            frames.kernel_timeouts(conn, self._timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            thread = threading.Thread(target=self._serve, args=(conn,), name="mc-conn", daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads.add(thread)
            thread.start()
        except (OSError, RuntimeError) as exc:  # RuntimeError: no thread could be started
            log.warning("cannot serve a new connection: %s", exc)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            idle = select.poll()
            idle.register(conn, select.POLLIN)
            while not self._stop.is_set():
                # Between requests a connection may wait: a pooled one up to IDLE_CLOSE_S, after which
                # it is closed, so that forgotten ones do not hold the connection limit. One holding
                # fences waits as long as it likes: its writer may still be copying (a stalled but
                # live writer holding memory is the safe failure; lifting the fence on a timer let a
                # late copy land in a block handed to another object), and if the writer dies the
                # kernel closes its socket, which lifts them. Such a connection holds a slot of
                # the limit as long as its writer is stuck, so it is named in the log.
                if not idle.poll(int(IDLE_CLOSE_S * 1000)):
                    held = len(self._fences.get(conn, ()))
                    if not held:
                        return
                    self._log_stalled_fences(conn, held)
                    if not idle.poll(None):
                        return
                started = time.monotonic()  # the request's deadline counts from here (_by)
                header = bytearray(frames.HEADER_BYTES)
                try:
                    frames.recv_into_by(conn, memoryview(header), self._by(started, 0), self._timeout_s)
                except TransferTimeout:
                    raise
                except TransferError:
                    return  # the client closed the connection
                try:
                    op, arg, a, b, c = frames.unpack(header)
                except ProtocolError:
                    if header[: len(frames.MAGIC)] == frames.MAGIC:  # ours, in another version
                        self._bad_request(conn, header[len(frames.MAGIC) + 1])
                    raise
                if not self._dispatch(conn, started, op, arg, a, b, c):
                    return
        except (ProtocolError, OSError, MooncakeError) as exc:
            log.info("closing connection: %s", exc)
        except Exception:  # a bug must cost this connection, not leave it half-served and silent
            log.exception("closing connection after an unexpected error")
        finally:
            # Fences this connection still holds end with it (the writer died or broke off).
            for alloc_id in self._fences.pop(conn, set()):
                self._table.end_write(alloc_id)
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def _log_stalled_fences(self, conn: socket.socket, held: int) -> None:
        """A connection that holds fences has sent nothing for IDLE_CLOSE_S: kept, but not in
        silence, so that an operator can find the stuck writer behind the memory and the slot."""
        try:
            host, port = conn.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "a peer"
        log.warning(
            "connection from %s holds %d fence(s) and has sent nothing for %g s: its writer is stalled; "
            "kept, with the fenced memory and one of the %d connection slots, until it unfences or "
            "closes (a late copy must not land in a re-granted block)",
            peer,
            held,
            IDLE_CLOSE_S,
            self.max_connections,
        )

    def _bad_request(self, conn: socket.socket, op: int) -> None:
        """Before closing on a frame of another protocol version or an op this agent lacks: a
        BAD_REQUEST reply in this agent's version (a = that version), so that the peer's unpack
        names both versions, or a newer client sees the op refused, instead of "peer closed the
        connection". A stream without our magic at all gets no reply."""
        with contextlib.suppress(OSError):
            conn.sendall(frames.pack(op | frames.REPLY_BIT, Status.BAD_REQUEST, frames.VERSION))

    def _reply(self, conn: socket.socket, op: Op, status: Status, a: int = 0, b: int = 0, c: int = 0) -> None:
        conn.sendall(frames.pack(op | frames.REPLY_BIT, status, a, b, c))

    def _by(self, started: float, length: int) -> float:
        """The deadline of a request that began at ``started`` and moves ``length`` bytes of
        payload (MIN_RATE_BPS)."""
        return started + self._timeout_s + length / MIN_RATE_BPS

    def _recv(self, conn: socket.socket, length: int, started: float) -> bytearray:
        buf = bytearray(length)
        frames.recv_into_by(conn, memoryview(buf), self._by(started, length), self._timeout_s)
        return buf

    def _send(self, conn: socket.socket, started: float, header: bytes, payload: bytes | bytearray) -> None:
        """A reply with a payload, by the request's deadline (the reader must keep up too)."""
        frames.send_all_by(conn, header, memoryview(payload), self._by(started, len(payload)), self._timeout_s)

    def _dispatch(self, conn: socket.socket, started: float, op: int, arg: int, a: int, b: int, c: int) -> bool:
        """Serve one request (begun at ``started``); False closes the connection (its stream can no
        longer be trusted)."""
        if op == Op.READ:
            return self._read(conn, started, a, b, c)
        if op == Op.WRITE:
            return self._write(conn, started, a, b, c)
        if op == Op.RESERVE:
            return self._reserve(conn, started, arg, a, b)
        if op == Op.FREE:
            return self._free(conn, started, arg)
        if op == Op.FENCE:
            return self._fence(conn, started, arg)
        if op == Op.UNFENCE:
            return self._unfence(conn, started, arg)
        if op == Op.DIGEST:
            return self._digest(conn, a, b, c)
        if op == Op.PING:
            self._reply(conn, Op.PING, Status.OK, frames.VERSION)
            return True
        log.warning("unknown op %d; closing the connection", op)
        self._bad_request(conn, op)
        return False

    def _in_arena(self, offset: int, length: int) -> bool:
        return offset >= 0 and length >= 0 and offset + length <= self._arena.size_bytes

    def _read(self, conn: socket.socket, started: float, alloc_id: int, offset: int, length: int) -> bool:
        if not self._in_arena(offset, length) or not self._table.begin_read(alloc_id, offset, length):
            return self._read_other_tier(conn, started, alloc_id, offset, length)
        try:
            # Counted before the reply goes: a client that has its bytes sees the read in stat().
            self._hooks.host_read(length)
            view = self._arena.view(offset, length)
            try:
                header = frames.pack(Op.READ | frames.REPLY_BIT, Status.OK, 0, 0, length)
                frames.send_all_by(conn, header, view, self._by(started, length), self._timeout_s)
            finally:
                view.release()
        finally:
            self._table.end_read(alloc_id)
        self.counters["reads"] += 1
        self.counters["read_bytes"] += length
        return True

    def _read_other_tier(self, conn: socket.socket, started: float, alloc_id: int, offset: int, length: int) -> bool:
        try:
            got = self._hooks.read_other_tier(alloc_id)
        except MooncakeError as exc:
            log.warning("read of allocation %d failed: %s", alloc_id, exc)
            got = None
        data, base = got if got is not None else (bytearray(), 0)
        start = offset - base
        if got is None or start < 0 or length < 0 or start + length > len(data):
            self._reply(conn, Op.READ, Status.STALE)
            return True
        view = memoryview(data)[start : start + length]
        header = frames.pack(Op.READ | frames.REPLY_BIT, Status.OK, 0, 0, length)
        try:
            frames.send_all_by(conn, header, view, self._by(started, length), self._timeout_s)
        finally:
            view.release()
        self.counters["reads"] += 1
        self.counters["read_bytes"] += length
        self._hooks.after_other_tier_read(alloc_id, data)
        return True

    def _write(self, conn: socket.socket, started: float, alloc_id: int, offset: int, length: int) -> bool:
        # Past its deadline a WRITE ends as one whose writer died: the fence is lifted, the
        # reservation stays until it is freed or expires, the connection closes.
        deadline = self._by(started, length)
        if self._in_arena(offset, length) and self._table.begin_write(alloc_id, offset, length):
            # Fenced: a free while the payload arrives waits, and voids the write (STALE).
            view = self._arena.view(offset, length)
            try:
                frames.recv_into_by(conn, view, deadline, self._timeout_s)
            finally:
                view.release()
                still_reserved = self._table.end_write(alloc_id)
            self.counters["writes"] += 1
            self.counters["write_bytes"] += length
            self._reply(conn, Op.WRITE, Status.OK if still_reserved else Status.STALE)
            return True
        staging = self._hooks.other_tier_staging(alloc_id, offset, length)
        if staging is not None:
            received = False
            try:
                frames.recv_into_by(conn, memoryview(staging), deadline, self._timeout_s)
                received = True
            finally:
                ok = self._hooks.other_tier_written(alloc_id, offset, staging if received else None)
            self._reply(conn, Op.WRITE, Status.OK if ok else Status.STALE)
            return True
        if length > self._arena.size_bytes:
            # Not worth draining: no such write can ever be valid. STALE as for any write that no
            # reservation covers, then the close (the payload, if sent, is not read).
            with contextlib.suppress(OSError):
                self._reply(conn, Op.WRITE, Status.STALE)
            return False
        remaining = length
        sink = memoryview(bytearray(min(DRAIN_BYTES, max(1, length))))
        while remaining:
            n = min(len(sink), remaining)
            frames.recv_into_by(conn, sink[:n], deadline, self._timeout_s)
            remaining -= n
        self._reply(conn, Op.WRITE, Status.STALE)
        return True

    def _digest(self, conn: socket.socket, alloc_id: int, offset: int, length: int) -> bool:
        """The checksum a TCP writer commits, taken here of the bytes as they landed: its source may
        have changed while it was sent, and a checksum taken there would then describe bytes that
        were never stored. The writer sends this right behind its WRITE, while the bytes are likely
        still in cache; it no longer hashes its source, so the put makes one pass over them either way. The
        range is fenced while it is hashed, as for a WRITE: a free meanwhile voids it (STALE)."""
        if not (self._in_arena(offset, length) and self._table.begin_write(alloc_id, offset, length)):
            self._reply(conn, Op.DIGEST, Status.STALE)
            return True
        try:
            view = self._arena.view(offset, length)
            try:
                checksum = xxhash.xxh3_64_intdigest(view)
            finally:
                view.release()
        finally:
            still_reserved = self._table.end_write(alloc_id)
        self._reply(conn, Op.DIGEST, *((Status.OK, checksum) if still_reserved else (Status.STALE,)))
        return True

    def _reserve(self, conn: socket.socket, started: float, count: int, tier: int, flags: int) -> bool:
        if not 0 < count <= frames.MAX_BATCH or tier not in (TIER_HOST, TIER_GPU, TIER_DISK):
            self._reply(conn, Op.RESERVE, Status.BAD_REQUEST)
            return False
        raw = self._recv(conn, frames.RESERVE_ENTRY.size * count, started)
        requests = [(size, bytes(put_id)) for size, put_id in frames.RESERVE_ENTRY.iter_unpack(raw)]
        if tier == TIER_DISK and any(size < DISK_HEADER.size for size, _ in requests):
            # No chunk file is shorter than its header: such entries could only fill the inbox with
            # reservations (8192 per frame) that nothing will ever write.
            self._reply(conn, Op.RESERVE, Status.BAD_REQUEST)
            return True
        if tier != TIER_HOST:
            allocs = self._hooks.reserve_other_tier(tier, requests, spill=bool(flags & SPILL_FLAG))
            if allocs is None:
                free, largest, capacity = self._hooks.other_tier_room(tier, spill=bool(flags & SPILL_FLAG))
                self._reply(conn, Op.RESERVE, Status.NO_CAPACITY, free, largest, capacity)
                return True
            if flags & SPILL_FLAG:
                self._hooks.spill_reserved([x.alloc_id for x in allocs], tier)
            payload = b"".join(frames.RESERVE_REPLY.pack(x.offset, x.alloc_id) for x in allocs)
            self._send(conn, started, frames.pack(Op.RESERVE | frames.REPLY_BIT, Status.OK), payload)
            return True
        allocs = self._table.reserve(requests)
        if allocs is None:
            # Space whose leases ran out since the last sync is free for the asking: a writer that
            # replaces objects quickly should not wait for the next sync tick.
            self._hooks.reclaim_now()
            allocs = self._table.reserve(requests)
        if allocs is None:
            _used, free, largest, _ = self._table.usage()
            self._reply(conn, Op.RESERVE, Status.NO_CAPACITY, free, largest, self._table.capacity_bytes)
            if not flags & SPILL_FLAG:  # a refused spill goes to another peer: no room is made for it
                self._hooks.no_room(sum(size for size, _ in requests))
            return True
        if flags & SPILL_FLAG:
            self._hooks.spill_reserved([x.alloc_id for x in allocs], tier)
        self._hooks.reserved()
        payload = b"".join(frames.RESERVE_REPLY.pack(x.offset, x.alloc_id) for x in allocs)
        self._send(conn, started, frames.pack(Op.RESERVE | frames.REPLY_BIT, Status.OK), payload)
        return True

    def _fence(self, conn: socket.socket, started: float, count: int) -> bool:
        """Fence host-tier reservations for a writer that copies into the shared arena itself (a
        same-host peer's spill): the reply names this arena (its digest) and says per id whether it
        is fenced (a live reservation, not being freed). Fences last until UNFENCE on this
        connection, or its close."""
        ids = self._ids(conn, started, Op.FENCE, count)
        if ids is None:
            return False
        fenced = self._fences.setdefault(conn, set())
        ok = bytearray(len(ids))
        for i, alloc_id in enumerate(ids):
            location = self._table.offset_of(alloc_id)
            if alloc_id not in fenced and location is not None and self._table.begin_write(alloc_id, *location):
                fenced.add(alloc_id)
                ok[i] = 1
        self._reply_flags(conn, started, Op.FENCE, ok, segment_digest(self._arena.name))
        return True

    def _unfence(self, conn: socket.socket, started: float, count: int) -> bool:
        """Lift fences this connection holds; per id whether the reservation is still live (False:
        freed meanwhile, so what was copied into it is void)."""
        ids = self._ids(conn, started, Op.UNFENCE, count)
        if ids is None:
            return False
        fenced = self._fences.get(conn, set())
        ok = bytearray(len(ids))
        for i, alloc_id in enumerate(ids):
            if alloc_id in fenced:
                fenced.discard(alloc_id)
                ok[i] = self._table.end_write(alloc_id)
        self._reply_flags(conn, started, Op.UNFENCE, ok)
        return True

    def _reply_flags(self, conn: socket.socket, started: float, op: Op, flags: bytearray, a: int = 0) -> None:
        """OK with one byte per id of the request (b = their count) after the header."""
        self._send(conn, started, frames.pack(op | frames.REPLY_BIT, Status.OK, a, len(flags)), flags)

    def _ids(self, conn: socket.socket, started: float, op: Op, count: int) -> list[int] | None:
        """The alloc ids of a FREE, FENCE or UNFENCE frame; None (BAD_REQUEST sent) for a bad count."""
        if not 0 < count <= frames.MAX_BATCH:
            self._reply(conn, op, Status.BAD_REQUEST)
            return None
        return frames.unpack_ids(self._recv(conn, frames.U64.size * count, started))

    def _free(self, conn: socket.socket, started: float, count: int) -> bool:
        ids = self._ids(conn, started, Op.FREE, count)
        if ids is None:
            return False
        freed = self._table.expire_now(ids) + self._hooks.expire_other_tiers(ids)
        self._reply(conn, Op.FREE, Status.OK, freed)
        return True
