"""The agent's TCP server: the listening socket, the accept loop (the connection limit, and BUSY
for connections past it: agent/refusals.py) and a thread per connection that reads each request's
header and hands it to the ops (agent/ops.py: reserve, free, fence, unfence, read, write, digest).

One thread per connection: the socket calls release the GIL, and clients keep a handful of
connections per agent. Every frame is checked before a byte of payload is read; a malformed
frame closes that connection only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import select
import socket
import threading
import time

from mooncake_store.agent import ops
from mooncake_store.agent.allocations import AllocationTable
from mooncake_store.agent.failure_log import FailureLog
from mooncake_store.agent.ops import AgentHooks, AgentOps
from mooncake_store.agent.read_budget import ReadBudget
from mooncake_store.agent.refusals import Refusals
from mooncake_store.config import split_host_port
from mooncake_store.errors import ConfigError, MooncakeError, ProtocolError, TransferError, TransferTimeout
from mooncake_store.tiers.host import HostArena
from mooncake_store.transport import frames
from mooncake_store.transport.tcp import SOCKET_BUFFER_BYTES

log = logging.getLogger("mooncake.agent")

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
#: A connection idle this long is closed (clients retire pooled ones sooner: tcp_pool.POOL_IDLE_S).
IDLE_CLOSE_S = 600.0


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


class AgentServer(AgentOps):
    """The listening socket, its accept loop (with the connection limit and the refusals past it)
    and one thread per connection reading request headers; the ops themselves are AgentOps'."""

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
            # The command line names an address this host cannot take (a port in use or below 1024, an
            # address not its own): the operator fixes it, so it is a config error, not "cannot connect".
            raise ConfigError(
                f"agent.listen={listen!r}: the agent cannot listen on {listen}: {exc.strerror or exc}; "
                f"{_listen_advice(exc, host, port)}"
            ) from None
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
        self._counters_lock = threading.Lock()
        # Frames of an op this agent lacks: told once, then at most every 30 s with a count (any
        # client that reaches the port could otherwise fill the log, a line a connection).
        self._unknown_ops = FailureLog(log, "a peer's frame", every_s=30.0)
        self._read_budget = ReadBudget()

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
        if self._accept_thread.ident is not None:  # stopped before it started: nothing runs
            self._accept_thread.join(timeout=2)
        for thread in list(self._threads):
            if thread.ident is not None:  # one whose start failed was never running
                thread.join(timeout=2)

    def _accept_loop(self) -> None:
        # One poll over the listening socket and the connections being turned away: a refusal
        # (waiting for the request, answering BUSY, reading what follows) never holds up accept()
        # for the next connection, and costs no thread.
        poller = select.poll()
        listen_fd = self._sock.fileno()
        poller.register(listen_fd, select.POLLIN)
        # A refused writer may pause between bytes as long as a served one may (one recv's timeout).
        refusals = Refusals(poller, self.max_connections, min_rate_bps=ops.MIN_RATE_BPS, idle_s=self._timeout_s)
        try:
            while not self._stop.is_set():
                try:
                    for fd, _events in poller.poll(math.ceil(refusals.wait_s(ACCEPT_POLL_S) * 1000)):
                        if fd == listen_fd:
                            if not self._accept_ready(refusals):
                                return
                        else:
                            self._step_refusal(refusals, fd)
                    refusals.expire()
                except Exception:
                    # A bug, not a condition of the host's (those are handled where they arise).
                    # This thread ending would leave the agent heartbeating while it serves no one,
                    # its objects unreadable and never repaired: it logs and goes on accepting.
                    log.exception("the accept loop failed; accepting again in %.1f s", ACCEPT_RETRY_S)
                    self._stop.wait(ACCEPT_RETRY_S)
        finally:
            refusals.close()

    @staticmethod
    def _step_refusal(refusals: Refusals, fd: int) -> None:
        try:
            refusals.step(fd)
        except Exception:  # a bug: that connection goes (it would be ready again at every poll)
            log.exception("turning away connection fd %d failed; closing it", fd)
            refusals.end(fd)

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
            try:
                self._admit(conn, refusals)
            except Exception:  # a bug: this connection goes, the next ones are served
                log.exception("admitting a new connection failed; closing it")
                with self._lock:
                    self._conns.discard(conn)
                conn.close()
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
        except OSError as exc:
            log.warning("cannot serve a new connection: %s", exc)
            conn.close()
            return
        thread = threading.Thread(target=self._serve, args=(conn,), name="mc-conn", daemon=True)
        with self._lock:
            self._conns.add(conn)
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:  # no thread could be started (a process or memory limit)
            log.warning("cannot serve a new connection: %s; turning it away as busy", exc)
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(thread)
            # Told BUSY like a connection over the limit (the client backs off and retries), not
            # reset without a word; the refusal costs no thread.
            refusals.add(conn)

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
                self.end_fence(alloc_id)
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


def _listen_advice(exc: OSError, host: str, port: int) -> str:
    """What to do about an address the agent could not listen on: "or port 0" was the advice for
    an address this host does not have too, already on port 0."""
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"{host} is not an address of this host: choose one it has "
            "(127.0.0.1 for this host alone, 0.0.0.0 for all of its interfaces)"
        )
    if exc.errno in (errno.EADDRINUSE, errno.EACCES) and port:
        why = "that port is taken" if exc.errno == errno.EADDRINUSE else "ports below 1024 need privileges"
        return f"{why}: choose another port, or port 0 to have a free one picked"
    return "choose another address" + (", or port 0 to have a free one picked" if port else "")
