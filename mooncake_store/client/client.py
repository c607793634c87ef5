"""The Client: puts and gets by key, with the index in Redis and the bytes over shm or TCP."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import numpy as np

from mooncake_store.client.async_calls import AsyncCalls
from mooncake_store.client.buffers import as_destination, check_disjoint, mark_written, to_array
from mooncake_store.client.gets import GetPath
from mooncake_store.client.in_flight import InFlight, on_pool_thread
from mooncake_store.client.node_view import NodeView
from mooncake_store.client.placed import PlacedSince
from mooncake_store.client.put_plans import check_put_options
from mooncake_store.client.puts import PutPath
from mooncake_store.client.stats import ClusterStats, build_stats
from mooncake_store.config import ClientConfig, Config, load_config, redact_url
from mooncake_store.config.values import transport_names
from mooncake_store.errors import (
    ConfigError,
    ConnectError,
    InvalidKey,
    InvalidValue,
    KeyNotFound,
    MooncakeError,
    NotPicklable,
    ObjectPinned,
    ProtocolError,
)
from mooncake_store.index import RedisIndex
from mooncake_store.tiers.gpu_arrays import is_device_array
from mooncake_store.transport.cancel import current_cancel
from mooncake_store.transport.shm import ShmTransport, local_host_id
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import (
    NodeInfo,
    ObjectMeta,
    Replica,
    TierKind,
    TransportKind,
    check_key,
    check_keys,
    is_collection_not_text,
)

if TYPE_CHECKING:
    from mooncake_store.client.device import GpuSegments

T = TypeVar("T")
#: Errors that answer the call whatever close() did meanwhile: about the caller's input or the
#: data itself, not about a transfer that close() may have cut.
STANDING_ERRORS = (InvalidKey, InvalidValue, KeyNotFound, ObjectPinned)


class Client(AsyncCalls):
    """A connection to one mooncake-store cluster (one Redis index, one namespace).

    Thread-safe. Every method that takes keys checks them (UTF-8 text, at most
    :data:`mooncake_store.types.MAX_KEY_BYTES` bytes, no control characters).
    """

    def __init__(
        self,
        redis_url: str,
        *,
        namespace: str = "default",
        config: ClientConfig | None = None,
        transports: Iterable[str] | None = None,
    ) -> None:
        for name, value in (("redis_url", redis_url), ("namespace", namespace)):
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be a str, got {type(value).__name__}: {value!r:.80}")
        if config is not None and not isinstance(config, ClientConfig):
            raise ConfigError(f"config must be a ClientConfig, got {type(config).__name__}: {config!r:.80}")
        self.config = config or ClientConfig()
        # The URL and namespace get the checks connect() gives them (a port 0, a database out of
        # range, a query's timeouts): built directly, a Client took them unchecked, and a mistake in
        # the URL failed at the first connect as an unreachable server.
        Config(redis_url=redis_url, namespace=namespace, client=self.config)
        if transports is not None:
            self.config = replace(self.config, transports=transport_names(transports))
        self.transports = tuple(TransportKind(t) for t in self.config.transports)
        self.redis_url = redis_url
        self.namespace = namespace
        self.index = RedisIndex(redis_url, namespace=namespace, timeout_s=self.config.timeout_s)
        self.host_id = local_host_id()
        self.zone = self.config.zone  # the writer's zone for placement (client.zone, MOONCAKE_ZONE)
        # What this client reserved on each node since its row in the node table was published
        # (placed.py): puts rank nodes by that row's free room less this.
        self._placed = PlacedSince()
        self._shm = ShmTransport()
        self._tcp = TcpTransport(
            timeout_s=self.config.timeout_s,
            connections_per_peer=self.config.tcp_connections,
            stripe_bytes=self.config.stripe_bytes,
        )
        self._gpu: GpuSegments | None = None  # opened on the first device transfer
        self._view = NodeView(self.index, self._shm, self._tcp, lambda: self._gpu)
        self._puts = PutPath(self)
        self._gets = GetPath(self)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        #: A forked child inherits this object but not its threads: a transfer striped over the
        #: pool waited forever for workers that do not exist there (see _interrupted).
        self._pid = os.getpid()
        self._closing = threading.Event()  # set with _closed: cuts a put's wait for room short
        #: Set with _closing: the stop events of threads that wait long on this client's behalf (a
        #: prefix cache's renewal waits a third of its lease, which may be days). Weak: a dropped
        #: cache's event goes with it.
        self._close_events: weakref.WeakSet[threading.Event] = weakref.WeakSet()
        self._closed_all = threading.Event()  # set when the first close() has done all it does
        #: Puts between their first and last index write: close() waits for them (in_flight.py).
        self._in_flight = InFlight(self._interrupted)

    # ---- life cycle -------------------------------------------------------------------------
    def _watch_close(self, event: threading.Event) -> None:
        """Set ``event`` when this client closes, or now if it has (a thread that waits long on
        its behalf ends with it)."""
        if os.getpid() != self._pid:
            # A forked child: a parent thread that held _pool_lock at the fork left it held here.
            event.set()
            return
        with self._pool_lock:  # close() copies the set under it: no change while it iterates
            if not self._closed:
                self._close_events.add(event)
                return
        event.set()

    def close(self) -> None:
        """Release connections, mappings and threads. Idempotent; may be called from any thread,
        a done-callback of this client's own futures included. Operations still under way in
        other threads end at once with MooncakeError("client is closed"), even those waiting on
        a stalled agent: close() shuts down their connections first.

        Not from a signal handler: the handler runs in the main thread between two of its steps,
        maybe while that thread holds a lock close() takes (this client's, its worker pool's, a
        future's), and close() then waits on it for good. A handler should set a flag the main
        thread acts on, or start a thread that calls close()."""
        if os.getpid() != self._pid:
            # A forked child's copy: its sockets are the parent's too (a shutdown here would cut
            # the parent's transfers) and its pool has no threads. It is only marked closed, and
            # before any lock: a parent thread that held one at the fork (a submit) left it held
            # here for good, and the child's close() hung on it.
            self._closed = True
            return
        with self._pool_lock:
            closing_elsewhere = self._closed
            self._closed = True
            self._closing.set()
            close_events = list(self._close_events)  # added under this lock (watch_close)
            pool = self._pool
        for event in close_events:
            event.set()
        if closing_elsewhere:
            # Another thread's close() is under way: this one returns when that one has, so that
            # what close() promises holds for every caller; but not on a worker of this client's
            # pool (a future's callback), which the first close() may be waiting for.
            if not on_pool_thread(pool):
                self._closed_all.wait()
            return
        try:
            # The transports before the wait for the pool: an operation waiting on an agent (up to
            # timeout_s on a stalled one) fails at once, and its retry loop, which sees _closed,
            # ends it with "client is closed". A put cut short this way is abandoned as any failed
            # put is: its pending record is revoked (the index stays open until the pool drained)
            # and its reservations, which no agent can be asked to free any more, are reclaimed by
            # their agents at the reservation timeout, as a dead writer's are. Nothing is committed
            # after its bytes were cut short: the commit follows only writes that all landed.
            self._view.stop()
            self._tcp.close()
            self._shm.close()
        finally:
            try:
                if pool is not None:
                    pool.shutdown(wait=not on_pool_thread(pool))
                # Puts in other threads: each is cut, or past its transfers and committing; none
                # commits after this, and none reopens the index's connections once it is closed.
                self._in_flight.drain(self.config.timeout_s)
            finally:
                try:
                    if self._gpu is not None:
                        self._gpu.close()
                    self.index.close()
                    self._view.join()
                finally:
                    self._closed_all.set()

    def __reduce__(self) -> NoReturn:
        raise NotPicklable(
            "a mooncake_store Client holds connections and mappings and cannot be pickled; "
            "call mooncake_store.connect() in each process"
        )

    def __enter__(self) -> Client:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _interrupted(self) -> MooncakeError | None:
        """The error that ends a call cut short: "client is closed" after close(), or the message
        of the Cancel the calling thread runs under (a closed PrefixCache's) once it was cancelled;
        None while neither happened."""
        if self._closed:
            return MooncakeError("client is closed")
        if os.getpid() != self._pid:
            return MooncakeError(
                f"this client was connected in process {self._pid}, and this is process {os.getpid()}, "
                "a fork of it: its connections, threads and mappings stay with that process; call "
                "mooncake_store.connect() in each process"
            )
        cancel = current_cancel()
        if cancel is not None and cancel.cancelled:
            return MooncakeError(cancel.message)
        return None

    def _check_open(self) -> None:
        error = self._interrupted()
        if error is not None:
            raise error

    def _raise_if_interrupted(self, exc: BaseException) -> None:
        """For a call's error path: when close() (or the call's Cancel) cut the call short, raise
        that instead of ``exc``, the transfer error it caused. STANDING_ERRORS stand."""
        if isinstance(exc, STANDING_ERRORS):
            return
        error = self._interrupted()
        if error is not None:
            raise error from exc

    # ---- node table (node_view.py) -----------------------------------------------------------
    def _node_table(self, *, refresh: bool = False) -> dict[str, NodeInfo]:
        return self._view.table(refresh=refresh)

    def _nodes_for(self, replicas: Iterable[Replica], nodes: dict[str, NodeInfo]) -> dict[str, NodeInfo]:
        return self._view.for_replicas(replicas, nodes)

    def _server_now_ms(self) -> int:
        return self._view.server_now_ms()

    # ---- puts -------------------------------------------------------------------------------
    def put(self, key: str, value: object, *, replicas: int = 1, preferred_node: str | None = None) -> None:
        """Store ``value`` under ``key``.

        ``value`` is bytes, a memoryview or any buffer, a numpy array, or a CPU torch tensor; its
        dtype and shape come back with :meth:`get`. Putting an existing key replaces it
        atomically: concurrent readers see the old object or the new one, never a mix, and the old
        bytes are freed only after every read lease on them has run out. Raises NoCapacity when no
        node has room, ObjectPinned when the key is pinned.

        The value is read in place, not copied first: it must not change until the call returns.
        If it does, the object stored holds its old bytes, its new ones or a mix, with the
        checksum of what was stored (taken where the bytes landed), so verifying reads accept it;
        with several replicas that received different bytes the put raises InvalidValue and
        stores nothing.
        """
        # The key checked before it keys a dict: one that cannot (a bytearray, a list) raised a
        # bare TypeError ("unhashable type") where every other bad key is an InvalidKey.
        self.put_many({check_key(key): value}, replicas=replicas, preferred_node=preferred_node)

    def put_many(
        self,
        items: Mapping[str, object],
        *,
        replicas: int = 1,
        preferred_node: str | None = None,
        chain_pos: Mapping[str, int] | None = None,
        chain_parent: Mapping[str, str] | None = None,
    ) -> None:
        """Store several objects with one index round trip per phase (start, commit) for the batch.

        Device arrays (cupy, or anything with ``__cuda_array_interface__``) go to same-host GPU
        tiers that can hold them, one per replica (on ``preferred_node``, if named), else they are
        staged to host memory once.

        For chunks of a prefix chain, ``chain_pos`` gives each key its position and ``chain_parent``
        the key of the chunk before it. Under memory pressure the cluster then evicts only chunks
        that no stored chunk hangs off, later and colder ones first, so chains stay prefix-closed.
        """
        with self._cut_by_close():  # the waits for room read the node table between attempts too
            replicas = check_put_options(replicas, preferred_node)
            plans = self._puts.plan(
                items, chain_pos=chain_pos, chain_parent=chain_parent, preferred_node=preferred_node, replicas=replicas
            )
            if plans:
                self._puts.run(plans, replicas=replicas, preferred_node=preferred_node)

    def _gpu_segments(self) -> GpuSegments:
        with self._pool_lock:
            if self._gpu is None:
                from mooncake_store.client.device import GpuSegments  # lazy: needs cupy

                self._gpu = GpuSegments()
                if self._closed:
                    # close() ran before this table existed, so it closed none: a device read that
                    # looked its key up before close() opened a mapping here that nothing closed.
                    self._gpu.close()
            return self._gpu

    # ---- gets -------------------------------------------------------------------------------
    def _use_shm(self, node: NodeInfo) -> bool:
        return (
            TransportKind.SHM in self.transports
            and TransportKind.SHM in node.transports
            and node.host_id == self.host_id
            and self._shm.reachable(node.shm_name)
        )

    def _can_write_to(self, node: NodeInfo) -> bool:
        """Whether a put's bytes may reach ``node``'s host tier by a transport this client allows:
        shm (same host, its arena mappable here) or tcp."""
        return (TransportKind.TCP in self.transports and TransportKind.TCP in node.transports) or self._use_shm(node)

    @staticmethod
    def _arena_bytes(node: NodeInfo) -> int:
        usage = node.tier(TierKind.HOST)
        return usage.capacity_bytes if usage else 0

    def get(self, key: str, *, device: str | int | None = None) -> Any:
        """The object stored under ``key`` as a numpy array of its dtype and shape (a torch tensor
        for bfloat16); with ``device="cuda:N"`` a cupy array on that GPU. Raises KeyNotFound (a
        KeyError) when there is no readable replica. ``device="cpu"`` is host memory, as None is."""
        if device is not None and device != "cpu":
            from mooncake_store.client import device as gpu  # lazy: needs cupy

            meta, buffer = gpu.read_to_device(self, check_key(key), device=device)
            return gpu.as_device_array(buffer, meta.dtype, meta.shape)
        (meta,), buffers = self._gets.get_batch([check_key(key)], None, missing_ok=False)
        assert meta is not None
        return to_array(buffers[0], meta.dtype, meta.shape)

    def get_into(self, key: str, out: object) -> int:
        """Copy the object's bytes into ``out`` (bytearray, numpy array, CPU torch tensor...) with no
        intermediate copy; returns the object's size, the bytes of ``out`` that hold it (a read made
        again after the object was replaced may have written past them). ``out`` must hold at least
        the object's size, and have its dtype unless one of the two is raw bytes (a bytearray, a
        uint8 array).
        A device array (cupy, CUDA torch tensor) is filled device-to-device where the object is in a
        same-host GPU tier, and host-to-device straight from a same-host arena otherwise."""
        if is_device_array(out):
            from mooncake_store.client import device as gpu  # lazy: needs cupy

            meta, _ = gpu.read_to_device(self, check_key(key), out=out)
            return meta.size_bytes
        dest = as_destination(out)
        try:
            (meta,), _ = self._gets.get_batch([check_key(key)], [dest], missing_ok=False)
        finally:
            mark_written([dest])  # a failed read may have written part of it too
        assert meta is not None
        return meta.size_bytes

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        """Several objects with one index round trip; None in place of a missing key."""
        checked = check_keys(keys)
        metas, buffers = self._gets.get_batch(checked, None, missing_ok=True)
        return [
            None if meta is None else to_array(buf, meta.dtype, meta.shape)
            for meta, buf in zip(metas, buffers, strict=True)
        ]

    def get_many_into(self, keys: Sequence[str], outs: Sequence[object]) -> list[int]:
        """Like get_into for a batch; returns bytes written per key (KeyNotFound if any is missing).
        With device arrays among ``outs`` (a list or tuple), each key is read as get_into reads it,
        a lookup each: device memory is filled by the device path, which reads one key at a time."""
        checked = check_keys(keys)
        if isinstance(outs, list | tuple) and any(is_device_array(o) for o in outs):
            if len(checked) != len(outs):
                raise InvalidValue(f"{len(checked)} keys but {len(outs)} output buffers")
            return [self.get_into(key, out) for key, out in zip(checked, outs, strict=True)]
        # A list of buffers, or one array with a row per key (a flat array's items are scalars).
        if not is_collection_not_text(outs) or (isinstance(outs, np.ndarray) and outs.ndim < 2):
            raise InvalidValue(
                f"outs must be buffers, one per key, or an array with a row per key, got {type(outs).__name__}"
                + (f" of shape {outs.shape}" if isinstance(outs, np.ndarray) else "")
            )
        dests = [as_destination(o) for o in outs]  # type: ignore[attr-defined]
        if len(checked) != len(dests):
            raise InvalidValue(f"{len(checked)} keys but {len(dests)} output buffers")
        check_disjoint(dests)
        try:
            metas, _ = self._gets.get_batch(checked, dests, missing_ok=False)
        finally:
            mark_written(dests)
        return [m.size_bytes if m else 0 for m in metas]

    # ---- other operations -------------------------------------------------------------------
    @contextlib.contextmanager
    def _cut_by_close(self) -> Iterator[None]:
        """Around a call's index round trips: one that close() cut short (the index connections
        closed under it) raises "client is closed", not the ConnectError the closing caused."""
        self._check_open()
        try:
            yield
        except MooncakeError as exc:
            self._raise_if_interrupted(exc)
            raise

    def object_meta(self, key: str) -> ObjectMeta | None:
        """Size, dtype, shape, checksum and readable replicas of ``key`` (None if absent); no lease."""
        with self._cut_by_close():
            return self.index.lookup([check_key(key)], lease_ms=0).objects[0]

    def exists(self, key: str) -> bool:
        """True when ``key`` has a complete replica on a live node (grants no lease)."""
        return self.object_meta(key) is not None

    def remove(self, key: str) -> bool:
        """Remove ``key``; False when it was absent. Readers that already looked it up finish their
        reads (its memory is freed after their leases). Raises ObjectPinned while pinned."""
        return self.remove_many([key])[0]

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        checked = check_keys(keys)
        with self._cut_by_close():
            statuses = self.index.remove(checked)
        # Keys left in place (malformed, pinned): the rest of the batch is gone all the same: say which.
        removed = [k for k, s in zip(checked, statuses, strict=True) if s == 1]
        malformed = [k for k, s in zip(checked, statuses, strict=True) if s == "MALFORMED"]
        if malformed:
            raise ProtocolError(
                f"key(s) {malformed[:5]!r}: their index records are malformed (written by hand or by another "
                "build) and were left in place" + (f"; removed the other {len(removed)} key(s)" if removed else "")
            )
        pinned = [k for k, s in zip(checked, statuses, strict=True) if s == "PINNED"]
        if pinned:
            raise ObjectPinned(
                f"key(s) {pinned[:5]!r} are pinned; release their pins first"
                + (f"; removed the other {len(removed)} key(s): {removed[:5]!r}" if removed else ""),
                pinned=pinned,
                done=removed,
            )
        return [s == 1 for s in statuses]

    def stat(self) -> ClusterStats:
        """Nodes with their tiers (capacity, used, objects), object count, bytes stored, hit counts."""
        with self._cut_by_close():
            nodes = self._node_table(refresh=True)
            objects, per_node, counters = self.index.counts(list(nodes))
            return build_stats(nodes, per_node, objects, counters, now_ms=self._server_now_ms())

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<Client {redact_url(self.redis_url)} namespace={self.namespace!r}{state}>"

    # ---- futures ----------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        # Checked under the lock that close() sets it under: a call racing close() gets "client is
        # closed", not the pool's own RuntimeError, and no pool is made after close() returned.
        # And before it: in a forked child a lock a parent thread held at the fork stays held, and
        # the call waited on it for good instead of being refused.
        self._check_open()
        with self._pool_lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.config.io_threads, thread_name_prefix="mc-io")
            return self._pool.submit(fn, *args, **kwargs)


def connect(
    url: str | None = None,
    *,
    namespace: str | None = None,
    transports: Iterable[str] | None = None,
    config_file: str | None = None,
    **client_options: Any,
) -> Client:
    """Connect to a cluster. With no URL, ``MOONCAKE_REDIS_URL`` (or the config file) names it.

    ``transports=("tcp",)`` forces a path; other keyword arguments override ClientConfig fields
    (``timeout_s``, ``lease_ms``, ``tcp_connections``, ...).
    """
    overrides: dict[str, object] = {"redis_url": url, "namespace": namespace}
    overrides.update({f"client.{k}": v for k, v in client_options.items()})
    if transports is not None:
        # As given, not joined into text: a refusal then quotes the caller's names as they were.
        overrides["client.transports"] = transport_names(transports)
    config = load_config(file=config_file, overrides=overrides)
    if not config.redis_url:
        raise ConnectError(
            "no cluster to connect to: pass a Redis URL to connect() (`mooncake stat --json` shows the "
            "one `mooncake up` runs here: connect() does not read its state file), set MOONCAKE_REDIS_URL, "
            "or start one with `mooncake up` or `with LocalCluster() as cluster: connect(cluster.redis_url)`"
        )
    return Client(config.redis_url, namespace=config.namespace, config=config.client)
