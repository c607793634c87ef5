"""A client's view of the node table: a copy read at most every NODE_TABLE_TTL_S, the index's time
reckoned from it, and the release of what agents that left the table had the client hold.

Each read of the table unmaps the arenas of agents no longer in it and closes their pooled
connections (and GPU handles): a mapping keeps a departed agent's whole arena allocated in
/dev/shm after its file is unlinked, and a pooled connection is an open descriptor. Reads of the
table come with gets and puts only; a client gone quiet, or making only index calls (exists,
remove, a prefix cache's match), kept a stopped agent's arena for good, which could leave no room
in /dev/shm for that agent's restart. So while the client holds a mapping or a pooled connection,
a thread of its own looks every RETAIN_EVERY_S whether a mapped arena's file is gone (a stat, no
index call) and reads the table then, or every REFRESH_EVERY_S in any case (also for a device reader's
GPU mappings, which no file tells of).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from mooncake_store.client.lease_clock import lease_clock_s
from mooncake_store.errors import MooncakeError
from mooncake_store.index import RedisIndex
from mooncake_store.transport.shm import ShmTransport
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import NodeInfo, Replica, stale_for

if TYPE_CHECKING:
    from mooncake_store.client.device import GpuSegments

log = logging.getLogger("mooncake.client")

#: How long a cached copy of the node table is trusted before a put re-reads it.
NODE_TABLE_TTL_S = 1.0
#: How often a client holding mappings or pooled connections looks for arenas whose files are gone.
RETAIN_EVERY_S = 2.0
#: How often such a client reads the table anyway (an agent killed and not yet swept leaves its file).
REFRESH_EVERY_S = 30.0


class NodeView:
    def __init__(
        self, index: RedisIndex, shm: ShmTransport, tcp: TcpTransport, gpu: Callable[[], GpuSegments | None]
    ) -> None:
        self._index, self._shm, self._tcp, self._gpu = index, shm, tcp, gpu
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_at = 0.0
        #: Whether a read of the table ever found a node: an empty one read after that is in flux
        #: (the index restarted empty; its agents register again at their next heartbeats).
        self.seen_nodes = False
        #: Per node read in the table, its heartbeat deadline as last read (server ms), kept after
        #: the node left the table until that deadline passed: one gone while its deadline still
        #: ran may be one the index forgot (it restarted empty), back at its next heartbeat.
        self.deadlines: dict[str, int] = {}
        # Server ms - lease-clock ms (lease_clock.py), refreshed with each read (till then: wall clock).
        self._clock_offset_ms = int((time.time() - lease_clock_s()) * 1000)
        self._lock = threading.Lock()
        #: How many reads of the table have ended (taken under the lock), and the error of the last
        #: one when it failed: a caller that queued on the lock behind a read that then failed gets
        #: that error at once. Each made a round trip of its own, one after another, so on a stalled
        #: index the k-th of k concurrent calls ended after k x timeout_s (and close() waited for it).
        self._reads_ended = 0
        self._read_error: MooncakeError | None = None
        self._stop = threading.Event()
        self._janitor: threading.Thread | None = None

    def table(self, *, refresh: bool = False) -> dict[str, NodeInfo]:
        # The module's constant looked up at each call (tests lengthen it).
        # On the lease clock, as server_now_ms: after a suspend the copy is stale, as "now" moved on.
        if not refresh and lease_clock_s() - self._nodes_at <= NODE_TABLE_TTL_S:
            return self._nodes  # fresh: no lock on the read path (the dict is replaced, never mutated)
        ended = self._reads_ended  # before waiting: a read that ends from here on is one waited for
        with self._lock:
            if self._read_error is not None and self._reads_ended != ended:
                # The read this call waited behind failed (the index is stalled or gone): the same
                # error now, not a round trip of its own to wait out in turn.
                raise copy.copy(self._read_error) from None
            if refresh or lease_clock_s() - self._nodes_at > NODE_TABLE_TTL_S:
                self._read_error = None  # a bug's exception is not handed on: the next caller reads
                try:
                    self._read()
                except MooncakeError as exc:
                    # A copy: the exception's traceback holds the failed call's frames, and with
                    # them its locals (a put's value) until the next read, maybe never.
                    self._read_error = copy.copy(exc)
                    raise
                finally:
                    self._reads_ended += 1
            return self._nodes

    def _read(self) -> None:
        """Read the table and the index's time (called with the lock)."""
        local_before = lease_clock_s() * 1000  # no wall-clock step moves it; a suspend does
        server_now = self._index.server_time_ms()
        self._nodes = self._index.nodes()
        self.seen_nodes = self.seen_nodes or bool(self._nodes)
        deadlines = {node: deadline for node, deadline in self.deadlines.items() if deadline >= server_now}
        deadlines.update((node_id, node.heartbeat_deadline_ms) for node_id, node in self._nodes.items())
        self.deadlines = deadlines  # replaced, never mutated: read without the lock
        self._clock_offset_ms = int(server_now - local_before)
        self._nodes_at = lease_clock_s()
        self._retain()

    def _retain(self) -> None:
        """Unmap, close and forget what agents no longer in the table left (called with the lock)."""
        self._shm.retain({n.shm_name for n in self._nodes.values() if n.shm_name})
        self._tcp.retain({n.tcp_endpoint for n in self._nodes.values()})
        gpu = self._gpu()
        if gpu is not None:
            gpu.retain(self._nodes)
        # Started with the first read: the mappings and connections come right after it.
        if self._janitor is None and not self._stop.is_set():
            # Given a weak reference only: a client dropped without close() must not be kept
            # alive by its own thread (the garbage collector closes its sockets and mappings).
            self._janitor = threading.Thread(
                target=_look_after, args=(weakref.ref(self), self._stop), name="mc-node-view", daemon=True
            )
            self._janitor.start()

    def for_replicas(self, replicas: Iterable[Replica], nodes: dict[str, NodeInfo]) -> dict[str, NodeInfo]:
        """``nodes``, or the table read afresh when a replica is on a node this copy lacks or was
        handed out by a later incarnation of its node than this copy knows (a node restarted
        within NODE_TABLE_TTL_S: its old row names the old arena, whose mapping must not be used)."""
        if any(r.node_id not in nodes or stale_for(r, nodes[r.node_id]) for r in replicas):
            return self.table(refresh=True)
        return nodes

    def server_now_ms(self) -> int:
        return int(lease_clock_s() * 1000) + self._clock_offset_ms

    def look_once(self) -> None:
        """What the janitor does every RETAIN_EVERY_S."""
        gpu = self._gpu()
        gpu_mapped = gpu is not None and gpu.open_count() > 0  # a device reader's IPC mappings
        if not (self._shm.mapped_any() or self._tcp.pooled or gpu_mapped):
            return
        if self._shm.vanished() or lease_clock_s() - self._nodes_at > REFRESH_EVERY_S:
            try:
                self.table(refresh=True)
            except MooncakeError as exc:  # the index is out of reach: the next look tries again
                log.debug("could not read the node table to release departed agents: %s", exc)

    def stop(self) -> None:
        """Stop the janitor at its next look (the client is closing)."""
        self._stop.set()

    def join(self) -> None:
        """Wait for the janitor, once the index is closed (a read of the table under way then fails
        at once, or within the index's timeout)."""
        janitor = self._janitor
        if janitor is not None and janitor is not threading.current_thread():
            janitor.join(timeout=10)


def _look_after(view: weakref.ref[NodeView], stop: threading.Event) -> None:
    """The janitor's loop, until the client closes or is dropped."""
    while not stop.wait(RETAIN_EVERY_S):
        alive = view()
        if alive is None:
            return
        try:
            alive.look_once()
        except Exception:  # a bug must not end the releases for the client's life
            log.exception("releasing departed agents' mappings and connections failed")
        del alive
