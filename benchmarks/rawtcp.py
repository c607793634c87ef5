"""Raw loopback TCP, the baseline of every TCP figure in the benchmarks: a server process, a
client, and the trials (see the comment below); and the machine's limits (memcpy and raw TCP)
measured together (measure_limits). Shared pieces come from benchlib."""

from __future__ import annotations

import contextlib
import functools
import mmap
import multiprocessing as mp
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from benchlib import (
    FOOTPRINT_BYTES,
    GB,
    Budget,
    budget_for,
    footprint_slots,
    gbps,
    measure_memcpy,
    run_in_process,
    stop_process,
    timed_loop,
)

from mooncake_store.config import ClientConfig
from mooncake_store.transport.frames import kernel_timeouts

#: Objects above this are striped over the connections, as the store's client stripes them (its
#: default stripe_bytes, read from the store rather than written here again).
STORE_STRIPE_BYTES = ClientConfig().stripe_bytes

#: Socket buffers of the raw TCP baseline when the store's value (transport/tcp.py) cannot be
#: imported; store_socket_buffer_bytes() reads the store's.
SOCKET_BUFFER_BYTES = 4 << 20

# ---- raw loopback TCP -----------------------------------------------------------------------------
# The baseline for every TCP figure: the best a plain Python socket loop does between two processes
# on this machine, with the store's socket options (TCP_NODELAY, its SO_SNDBUF/SO_RCVBUF) and its
# socket mode on both sides (blocking, bounded by kernel timeouts, payloads received with one
# MSG_WAITALL call: frames.kernel_timeouts), so that the limit is not handicapped by Python's
# timeout mode, which poll()s before every recv and send. Two loops:
#
# - request/response ("rr"): one request per object, the object comes back (get) or goes out and is
#   acked (put): a round trip per object, as the store's reads and writes have;
# - stream: one request, then ``count`` objects back to back on the same connection(s): the wire
#   limit of a Python sendall/recv_into loop, with no round trip in between.
#
# The machine is shared and noisy (a burst from another process halves a figure for a second or
# two), so each is measured in several short trials interleaved over the sizes, and the limit is
# the best trial of either loop; every trial is kept in the results ("trials") for the spread.
#
# Wire format: a request is two u64s, (length, with PUT_BIT set for a put; count). A get is
# answered with ``count`` objects of ``length`` bytes back to back; a put's ``count`` objects are
# followed by a one-byte ack. count == 1 is the request/response loop.
REQ = struct.Struct("<QQ")
PUT_BIT = 1 << 63
#: Objects per stream request at most (a stream trial is also bounded by its seconds).
MAX_STREAM_COUNT = 200_000
#: Trials per (size, op, loop) and seconds per trial: (quick, full).
RAW_TRIALS = (3, 5)
RAW_TRIAL_S = (0.25, 0.4)
#: Kernel send/receive timeout of every raw socket: a stuck peer fails the trial instead of hanging.
RAW_IO_TIMEOUT_S = 30.0
#: How often the raw server checks that its parent (the benchmark) is still there.
RAW_PARENT_CHECK_S = 0.5


@functools.cache
def store_socket_buffer_bytes() -> int:
    """SO_SNDBUF/SO_RCVBUF of the store's TCP transport (its agents set the same), so that the
    baseline cannot drift from what it is compared with."""
    try:
        from mooncake_store.transport.tcp import SOCKET_BUFFER_BYTES as store_value
    except ImportError:
        return SOCKET_BUFFER_BYTES
    return int(store_value)


def tune(sock: socket.socket, buffer_bytes: int | None = None) -> None:
    """The store's socket options: TCP_NODELAY and its buffer sizes."""
    size = store_socket_buffer_bytes() if buffer_bytes is None else buffer_bytes
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if size:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


def _recv_exact(sock: socket.socket, view: memoryview, *, idle_ok: bool = False) -> bool:
    """Fill ``view`` from the socket; False if the peer closed first. On a blocking socket (kernel
    timeouts) the kernel fills the view in one MSG_WAITALL call, as the store's recv_into_exact does.
    ``idle_ok``: a receive timeout before the first byte is waited out (an idle connection between
    requests, as the agent's idle connections wait as long as they like); any other raises."""
    got, total = 0, len(view)
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    while got < total:
        try:
            n = sock.recv_into(view[got:], total - got, flags)
        except BlockingIOError:  # SO_RCVTIMEO ran out (EAGAIN)
            if idle_ok and got == 0:
                continue
            raise
        if n == 0:
            return False
        got += n
    return True


def _serve_raw(conn: socket.socket, view: memoryview) -> None:
    """One connection of the raw server: gets are sent from, puts received into, ``view``, the slot
    rotating over FOOTPRINT_BYTES as the agent's arena rotates over the benchmark's keys."""
    head = memoryview(bytearray(REQ.size))
    slot = 0
    with conn:
        while _recv_exact(conn, head, idle_ok=True):
            word, count = REQ.unpack(head)
            length = word & ~PUT_BIT
            slots = footprint_slots(max(1, length))
            if slots * length > len(view) or not 1 <= count <= MAX_STREAM_COUNT:
                return  # not a request of this benchmark's client
            for _ in range(count):
                base = (slot % slots) * length
                slot += 1
                if not word & PUT_BIT:
                    conn.sendall(view[base : base + length])
                elif not _recv_exact(conn, view[base : base + length]):
                    return
            if word & PUT_BIT:
                conn.sendall(b"\x01")


def shared_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of shared memory, touched: an anonymous MAP_SHARED mapping, which the kernel
    backs as it backs an agent's arena (shmem, the memory of /dev/shm). Private anonymous memory
    (numpy's) gets transparent huge pages where the kernel allows them for anonymous memory, and
    shared memory only where it allows them for shmem (often not: shmem_enabled=never by default),
    so a copy in or out of shared memory may walk 512 times as many pages. A raw baseline for a
    transfer between two agents' arenas copies out of and into this kind of memory."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
    np.frombuffer(mm, dtype=np.uint8).fill(1)  # touched in place, no bytes object of that size
    return memoryview(mm)


def raw_buffer(nbytes: int, *, shared: bool) -> memoryview:
    """``nbytes`` of touched memory for a raw baseline: shared (shared_buffer) or private (numpy)."""
    return shared_buffer(nbytes) if shared else memoryview(np.ones(nbytes, dtype=np.uint8)).cast("B")


def _raw_server(
    listener: socket.socket,
    max_bytes: int,
    buffer_bytes: int,
    stop: threading.Event,
    parent_pid: int | None = None,
    *,
    shared: bool = False,
) -> None:
    """Accept connections until ``stop`` is set or, with ``parent_pid``, until the parent is gone
    (this process was re-parented: a benchmark killed with SIGKILL cannot stop it by its PID). The
    connection threads are daemons: they end with the process. ``shared``: puts land in shared
    memory (shared_buffer), as in an agent's arena."""
    # Touched (no zero-page reads) and large enough for every size's rotation (footprint_slots).
    view = raw_buffer(max(FOOTPRINT_BYTES, 2 * max_bytes) + max_bytes, shared=shared)
    listener.settimeout(RAW_PARENT_CHECK_S)
    while not stop.is_set() and (parent_pid is None or os.getppid() == parent_pid):
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            break
        kernel_timeouts(conn, RAW_IO_TIMEOUT_S)  # the agent's mode: blocking, MSG_WAITALL receives
        tune(conn, buffer_bytes)
        threading.Thread(target=_serve_raw, args=(conn, view), daemon=True).start()


def raw_server_main(port_pipe: Any, max_bytes: int, buffer_bytes: int, shared: bool = False) -> None:
    """Child process: a plain threaded socket server (a thread per connection); it ends by itself
    once its parent is gone."""
    parent_pid = os.getppid()
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port_pipe.send(listener.getsockname()[1])
    port_pipe.close()
    _raw_server(listener, max_bytes, buffer_bytes, threading.Event(), parent_pid, shared=shared)


def stripes_of(length: int, connections: int, stripe_bytes: int) -> list[tuple[int, int]]:
    """The store's striping rule (transport/tcp.py), so the baseline splits objects the same way."""
    if length <= stripe_bytes or connections == 1:
        return [(0, length)]
    count = min(connections, -(-length // stripe_bytes))
    step = -(-length // count)
    step = -(-step // 4096) * 4096
    return [(start, min(step, length - start)) for start in range(0, length, step)]


class RawClient:
    """The raw server's client over ``connections`` sockets. ``get``/``put`` move one object per
    request (request/response); ``stream_get``/``stream_put`` move ``count`` objects per request.
    Objects above ``stripe_bytes`` are striped over the connections like the store's."""

    def __init__(self, port: int, connections: int, stripe_bytes: int = STORE_STRIPE_BYTES) -> None:
        self.socks = []
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", port), timeout=RAW_IO_TIMEOUT_S)
            tune(s)
            kernel_timeouts(s, RAW_IO_TIMEOUT_S)  # the store client's mode: blocking, MSG_WAITALL receives
            self.socks.append(s)
        self.stripe_bytes = stripe_bytes
        self.pool = None
        if connections > 1:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=connections - 1)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for s in self.socks:
            s.close()

    @staticmethod
    def _get(sock: socket.socket, view: memoryview, count: int = 1) -> None:
        sock.sendall(REQ.pack(len(view), count))
        for _ in range(count):
            if not _recv_exact(sock, view):
                raise ConnectionError("raw server closed")

    @staticmethod
    def _put(sock: socket.socket, view: memoryview, count: int = 1) -> None:
        head = REQ.pack(len(view) | PUT_BIT, count)
        if count == 1:  # header and payload in one sendmsg, as the store's writes
            sent = sock.sendmsg([head, view])
            if sent < len(head):
                sock.sendall(head[sent:])
                sent = len(head)
            if sent - len(head) < len(view):
                sock.sendall(view[sent - len(head) :])
        else:
            sock.sendall(head)
            for _ in range(count):
                sock.sendall(view)
        if sock.recv(1) != b"\x01":
            raise ConnectionError("raw server did not ack")

    @staticmethod
    def _put_from(sock: socket.socket, views: list[memoryview]) -> None:
        """A stream of puts of equal-sized objects from ``views`` in turn, then one ack."""
        sock.sendall(REQ.pack(len(views[0]) | PUT_BIT, len(views)))
        for view in views:
            sock.sendall(view)
        if sock.recv(1) != b"\x01":
            raise ConnectionError("raw server did not ack")

    def _striped(self, op: Callable[..., None], view: memoryview, count: int) -> None:
        stripes = stripes_of(len(view), len(self.socks), self.stripe_bytes)
        if len(stripes) == 1:
            op(self.socks[0], view, count)
            return
        assert self.pool is not None
        futs = [
            self.pool.submit(op, self.socks[k], view[s : s + n], count) for k, (s, n) in enumerate(stripes[1:], start=1)
        ]
        s, n = stripes[0]
        op(self.socks[0], view[s : s + n], count)
        for f in futs:
            f.result()

    def each_connection(self, fn: Callable[[int, socket.socket], None]) -> None:
        """``fn(k, sock)`` on every connection at once (the first on this thread); the first error
        is raised once all are done."""
        if len(self.socks) == 1:
            fn(0, self.socks[0])
            return
        assert self.pool is not None
        futs = [self.pool.submit(fn, k, sock) for k, sock in enumerate(self.socks[1:], start=1)]
        try:
            fn(0, self.socks[0])
        finally:
            for f in futs:
                f.result()

    def get(self, view: memoryview) -> None:
        self._striped(self._get, view, 1)

    def put(self, view: memoryview) -> None:
        self._striped(self._put, view, 1)

    def stream_get(self, view: memoryview, count: int) -> None:
        """``count`` objects into ``view``, back to back (each overwrites the last)."""
        self._striped(self._get, view, count)

    def stream_put(self, view: memoryview, count: int) -> None:
        self._striped(self._put, view, count)


@contextlib.contextmanager
def raw_tcp_server(max_bytes: int, buffer_bytes: int | None = None, *, shared: bool = False):  # type: ignore[no-untyped-def]
    """A raw socket server in a spawned child process; yields its port; stops it by PID. Its
    sockets get ``buffer_bytes`` (default: the store's SOCKET_BUFFER_BYTES); ``shared``: puts land
    in shared memory (shared_buffer)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    size = store_socket_buffer_bytes() if buffer_bytes is None else buffer_bytes
    proc = ctx.Process(target=raw_server_main, args=(child, max_bytes, size, shared), daemon=True)
    proc.start()
    try:
        if not parent.poll(30):
            raise RuntimeError("raw TCP server did not start within 30 s")
        yield parent.recv()
    finally:
        stop_process(proc)


def _stream_trial(run: Callable[[int], None], size: int, seconds: float, rate_gbps: float) -> float:
    """GB/s of one stream of about ``seconds``; the object count is guessed from ``rate_gbps`` and
    corrected once if the stream came out much shorter."""
    count = int(min(MAX_STREAM_COUNT, max(3, seconds * rate_gbps * GB / size)))
    clock = time.perf_counter
    while True:
        t0 = clock()
        run(count)
        secs = clock() - t0
        if secs >= seconds / 3 or count >= MAX_STREAM_COUNT:
            return gbps(count * size, secs)
        count = int(min(MAX_STREAM_COUNT, count * seconds / max(secs, 1e-4)))


def _objects_rr_trial(client: RawClient, op: str, views: list[memoryview], bound: Budget) -> float:
    """GB/s of whole objects moved request/response on every connection at once, each connection
    in its own loop of about ``bound.seconds`` (the pattern of the store's spill streams). A get
    lands in ``views[0]``; puts go out from ``views`` in turn."""
    clock = time.perf_counter
    conns = len(client.socks)
    counts = [0] * conns
    per_conn = max(bound.min_count, bound.count // conns)

    def move(k: int, sock: socket.socket) -> None:
        if op == "get":
            RawClient._get(sock, views[0])
        else:
            RawClient._put(sock, views[(counts[k] * conns + k) % len(views)])

    client.each_connection(move)  # warm-up

    def loop(k: int, sock: socket.socket) -> None:
        deadline = clock() + bound.seconds
        while counts[k] < per_conn and (counts[k] < bound.min_count or clock() < deadline):
            move(k, sock)
            counts[k] += 1

    t0 = clock()
    client.each_connection(loop)
    return gbps(sum(counts) * len(views[0]), clock() - t0)


def objects_stream(client: RawClient, op: str, views: list[memoryview], count: int) -> None:
    """Exactly ``count`` whole objects (what _stream_trial credits) dealt over the connections, the
    first ``count % conns`` taking one more, each connection streaming its share (gets into
    ``views[0]``, puts from ``views`` in turn). A connection whose share is nothing sends nothing."""
    conns = len(client.socks)
    base, extra = divmod(count, conns)

    def move(k: int, sock: socket.socket) -> None:
        share = base + (k < extra)
        if not share:
            return
        if op == "get":
            RawClient._get(sock, views[0], share)
        else:
            RawClient._put_from(sock, [views[(i * conns + k) % len(views)] for i in range(share)])

    client.each_connection(move)


def objects_rr(client: RawClient, views: list[memoryview], count: int) -> None:
    """Exactly ``count`` whole objects put request/ack (one in flight per connection), dealt
    round-robin over the connections (object i on connection i % conns, from ``views`` in turn):
    objects_stream's count, one ack per object instead of one per share."""
    conns = len(client.socks)

    def move(k: int, sock: socket.socket) -> None:
        for i in range(k, count, conns):
            RawClient._put(sock, views[i % len(views)])

    client.each_connection(move)


def measure_raw_tcp(
    port: int,
    sizes: tuple[int, ...],
    connections: int,
    *,
    quick: bool,
    stripe_bytes: int = STORE_STRIPE_BYTES,
    trials: int | None = None,
    trial_s: float | None = None,
    whole_objects: bool = False,
    shared: bool = False,
) -> dict[str, Any]:
    """Raw loopback TCP over ``connections``: gets (server -> client) and puts (client -> server).

    By default an object above ``stripe_bytes`` is striped over the connections as the store's
    client does (smaller ones use one connection), and puts send one buffer over and over, as the
    store's benchmark puts one value; with ``whole_objects`` every connection carries whole objects
    at the same time and puts send from sources rotating over FOOTPRINT_BYTES, as an agent's spill
    streams send objects out of its arena; ``shared`` takes those sources from shared memory
    (shared_buffer), the memory an arena is.

    Returns ``{"get": {size: GB/s}, "put": {size: GB/s}, "trials": ...}``: the figure per size is
    the best trial of the request/response and the stream loops; ``trials[op][loop][size]`` lists
    every trial (``loop`` is "rr" or "stream"). Rounds go over all sizes and both ops, so that a
    noisy second costs one trial of a few cells, not every trial of one."""
    trials = trials or RAW_TRIALS[not quick]
    trial_s = trial_s or RAW_TRIAL_S[not quick]
    client = RawClient(port, connections, stripe_bytes)
    samples: dict[str, dict[str, dict[int, list[float]]]] = {
        op: {loop: {size: [] for size in sizes} for loop in ("rr", "stream")} for op in ("get", "put")
    }
    bufs = {size: memoryview(np.ones(size, dtype=np.uint8)).cast("B") for size in sizes}
    sources: dict[int, list[memoryview]] = {}
    if whole_objects:
        for size in sizes:
            pool = raw_buffer(footprint_slots(size) * size, shared=shared)
            sources[size] = [pool[k * size : (k + 1) * size] for k in range(footprint_slots(size))]
    try:
        for _ in range(trials):
            for size in sizes:
                view = bufs[size]
                bound = Budget(count=budget_for(size, quick=quick).count, seconds=trial_s)
                for op, one, many in (
                    ("get", client.get, client.stream_get),
                    ("put", client.put, client.stream_put),
                ):
                    if whole_objects:
                        views = [view] if op == "get" else sources[size]
                        rr = _objects_rr_trial(client, op, views, bound)
                        stream = _stream_trial(
                            lambda c, o=op, vs=views: objects_stream(client, o, vs, c), size, trial_s, rr
                        )
                    else:
                        n, secs, _ = timed_loop(lambda _i, f=one, v=view: f(v), bound)
                        rr = gbps(n * size, secs)
                        stream = _stream_trial(lambda c, f=many, v=view: f(v, c), size, trial_s, rr)
                    samples[op]["rr"][size].append(rr)
                    samples[op]["stream"][size].append(stream)
    finally:
        client.close()
    res: dict[str, Any] = {
        op: {size: max(max(samples[op][loop][size]) for loop in ("rr", "stream")) for size in sizes}
        for op in ("get", "put")
    }
    res["trials"] = samples
    return res


def merge_raw_tcp(*results: dict[str, Any]) -> dict[str, Any]:
    """``measure_raw_tcp`` results of the same sizes (say one before and one after the store's
    figures, so that the baseline does not sit in a single window of a shared machine) as one: every
    trial, and the best of them."""
    trials: dict[str, dict[str, dict[int, list[float]]]] = {}
    for res in results:
        for op, loops in res["trials"].items():
            for loop, per_size in loops.items():
                for size, vals in per_size.items():
                    trials.setdefault(op, {}).setdefault(loop, {}).setdefault(size, []).extend(vals)
    merged: dict[str, Any] = {
        op: {size: max(max(loops[loop][size]) for loop in loops) for size in next(iter(loops.values()))}
        for op, loops in trials.items()
    }
    merged["trials"] = trials
    return merged


def raw_tcp_spread(res: dict[str, Any], op: str, size: int) -> dict[str, float]:
    """From one ``measure_raw_tcp`` result: the best, and the median and min of each loop's trials."""
    out = {"best": float(res[op][size])}
    for loop, vals in res.get("trials", {}).get(op, {}).items():
        if vals.get(size):
            out[f"{loop}_median"] = float(np.median(vals[size]))
            out[f"{loop}_min"] = float(min(vals[size]))
    return out


def raw_tcp_worker(port: int, sizes: tuple[int, ...], connections: int, quick: bool, queue: Any) -> None:
    try:
        queue.put(("ok", measure_raw_tcp(port, sizes, connections, quick=quick)))
    except BaseException as exc:
        queue.put(("error", repr(exc)))


def raw_tcp_objects_worker(
    port: int, sizes: tuple[int, ...], connections: int, quick: bool, shared: bool, queue: Any
) -> None:
    """As raw_tcp_worker, with whole objects on every connection at once (``whole_objects``), from
    shared memory with ``shared`` (the server must then receive into it too)."""
    try:
        queue.put(("ok", measure_raw_tcp(port, sizes, connections, quick=quick, whole_objects=True, shared=shared)))
    except BaseException as exc:
        queue.put(("error", repr(exc)))


def measure_limits(sizes: tuple[int, ...], *, quick: bool, connections: tuple[int, ...]) -> dict[str, Any]:
    """memcpy per size, and raw loopback TCP gets/puts per size for each connection count (best of
    the request/response and stream loops over a few trials; see measure_raw_tcp), measured from a
    client process talking to a server process (the parent only orchestrates)."""
    memcpy = measure_memcpy(sizes, quick=quick)
    tcp: dict[int, dict[str, Any]] = {}
    with raw_tcp_server(max(sizes)) as port:
        for conns in connections:
            tcp[conns] = run_in_process(raw_tcp_worker, port, sizes, conns, quick)
    return {"memcpy": memcpy, "tcp": tcp}
