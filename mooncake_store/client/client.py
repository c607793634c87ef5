"""The Client: puts and gets by key, with the index in Redis and the bytes over shm or TCP."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from mooncake_store.client.buffers import as_destination, to_array
from mooncake_store.client.puts import PutPath, checksum_of
from mooncake_store.client.stats import ClusterStats, build_stats
from mooncake_store.config import ClientConfig, load_config
from mooncake_store.errors import (
    ConnectError,
    InvalidValue,
    KeyNotFound,
    MooncakeError,
    ObjectPinned,
    TransferError,
)
from mooncake_store.index import RedisIndex
from mooncake_store.policy.transport_choice import order_replicas
from mooncake_store.transport.shm import ShmTransport, local_host_id
from mooncake_store.transport.tcp import ReadRequest, TcpTransport
from mooncake_store.types import (
    NodeInfo,
    ObjectMeta,
    Replica,
    TierKind,
    TransportKind,
    check_key,
)

if TYPE_CHECKING:
    from mooncake_store.client.device import GpuSegments

T = TypeVar("T")
#: How long a cached copy of the node table is trusted before a put re-reads it.
NODE_TABLE_TTL_S = 1.0
#: Re-check an shm read against the index when it ends within this fraction of its lease.
LEASE_SAFETY = 0.8


class Client:
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
        self.config = config or ClientConfig()
        if transports is not None:
            self.config = replace(self.config, transports=tuple(transports))
        self.transports = tuple(TransportKind(t) for t in self.config.transports)
        self.redis_url = redis_url
        self.namespace = namespace
        self.index = RedisIndex(redis_url, namespace=namespace, timeout_s=self.config.timeout_s)
        self.host_id = local_host_id()
        self.zone = os.environ.get("MOONCAKE_ZONE", "default")
        self._shm = ShmTransport()
        self._tcp = TcpTransport(
            timeout_s=self.config.timeout_s,
            connections_per_peer=self.config.tcp_connections,
            stripe_bytes=self.config.stripe_bytes,
        )
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_at = 0.0
        self._clock_offset_ms = 0  # server ms - local ms, refreshed with the node table
        self._nodes_lock = threading.Lock()
        self._puts = PutPath(self)
        self._gpu: GpuSegments | None = None  # opened on the first device transfer
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False

    # ---- life cycle -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._tcp.close()
        self._shm.close()
        if self._gpu is not None:
            self._gpu.close()
        self.index.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise MooncakeError("client is closed")

    # ---- node table -------------------------------------------------------------------------
    def _node_table(self, *, refresh: bool = False) -> dict[str, NodeInfo]:
        if not refresh and time.monotonic() - self._nodes_at <= NODE_TABLE_TTL_S:
            return self._nodes  # fresh: no lock on the read path (the dict is replaced, never mutated)
        with self._nodes_lock:
            if refresh or time.monotonic() - self._nodes_at > NODE_TABLE_TTL_S:
                local_before = time.time() * 1000
                server_now = self.index.server_time_ms()
                self._nodes = self.index.nodes()
                self._clock_offset_ms = int(server_now - local_before)
                self._nodes_at = time.monotonic()
            return self._nodes

    def _server_now_ms(self) -> int:
        return int(time.time() * 1000) + self._clock_offset_ms

    # ---- puts -------------------------------------------------------------------------------
    def put(self, key: str, value: object, *, replicas: int = 1, preferred_node: str | None = None) -> None:
        """Store ``value`` under ``key``.

        ``value`` is bytes, a memoryview or any buffer, a numpy array, or a CPU torch tensor; its
        dtype and shape come back with :meth:`get`. Putting an existing key replaces it
        atomically: concurrent readers see the old object or the new one, never a mix, and the old
        bytes are freed only after every read lease on them has run out. Raises NoCapacity when no
        node has room, ObjectPinned when the key is pinned.
        """
        self.put_many({key: value}, replicas=replicas, preferred_node=preferred_node)

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

        Device arrays (cupy, or anything with ``__cuda_array_interface__``) go to a same-host GPU
        tier when one exists, else they are staged to host memory once.

        For chunks of a prefix chain, ``chain_pos`` gives each key its position and ``chain_parent``
        the key of the chunk before it. Under memory pressure the cluster then evicts only chunks
        that no stored chunk hangs off, later and colder ones first, so chains stay prefix-closed.
        """
        self._check_open()
        plans = self._puts.plan(items, chain_pos=chain_pos, chain_parent=chain_parent)
        if plans:
            self._puts.run(plans, replicas=replicas, preferred_node=preferred_node)

    def _gpu_segments(self) -> GpuSegments:
        with self._pool_lock:
            if self._gpu is None:
                from mooncake_store.client.device import GpuSegments  # lazy: needs cupy

                self._gpu = GpuSegments()
            return self._gpu

    # ---- gets -------------------------------------------------------------------------------
    def _use_shm(self, node: NodeInfo) -> bool:
        return (
            TransportKind.SHM in self.transports
            and TransportKind.SHM in node.transports
            and node.host_id == self.host_id
            and self._shm.reachable(node.shm_name)
        )

    @staticmethod
    def _arena_bytes(node: NodeInfo) -> int:
        usage = node.tier(TierKind.HOST)
        return usage.capacity_bytes if usage else 0

    def get(self, key: str, *, device: str | int | None = None) -> Any:
        """The object stored under ``key`` as a numpy array of its dtype and shape (a torch tensor
        for bfloat16); with ``device="cuda:N"`` a cupy array on that GPU. Raises KeyNotFound (a
        KeyError) when there is no readable replica."""
        if device is not None:
            from mooncake_store.client import device as gpu  # lazy: needs cupy

            meta, buffer = gpu.read_to_device(self, check_key(key), device=device)
            return gpu.as_device_array(buffer, meta.dtype, meta.shape)
        (meta,), buffers = self._get_batch([check_key(key)], None, missing_ok=False)
        assert meta is not None
        return to_array(buffers[0], meta.dtype, meta.shape)

    def get_into(self, key: str, out: object) -> int:
        """Copy the object's bytes into ``out`` (bytearray, numpy array, CPU torch tensor...) with no
        intermediate copy; returns the bytes written. ``out`` must hold at least the object's size.
        A device array (cupy, CUDA torch tensor) is filled device-to-device where the object is in a
        same-host GPU tier, and host-to-device straight from a same-host arena otherwise."""
        if hasattr(out, "__cuda_array_interface__"):
            from mooncake_store.client import device as gpu  # lazy: needs cupy

            meta, _ = gpu.read_to_device(self, check_key(key), out=out)
            return meta.size_bytes
        dest = as_destination(out)
        (meta,), _ = self._get_batch([check_key(key)], [dest], missing_ok=False)
        assert meta is not None
        return meta.size_bytes

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        """Several objects with one index round trip; None in place of a missing key."""
        checked = [check_key(k) for k in keys]
        metas, buffers = self._get_batch(checked, None, missing_ok=True)
        return [
            None if meta is None else to_array(buf, meta.dtype, meta.shape)
            for meta, buf in zip(metas, buffers, strict=True)
        ]

    def get_many_into(self, keys: Sequence[str], outs: Sequence[object]) -> list[int]:
        """Like get_into for a batch; returns bytes written per key (KeyNotFound if any is missing)."""
        if len(keys) != len(outs):
            raise InvalidValue(f"{len(keys)} keys but {len(outs)} output buffers")
        dests = [as_destination(o) for o in outs]
        metas, _ = self._get_batch([check_key(k) for k in keys], dests, missing_ok=False)
        return [m.size_bytes if m else 0 for m in metas]

    def _get_batch(
        self, keys: list[str], dests: list[memoryview] | None, *, missing_ok: bool
    ) -> tuple[list[ObjectMeta | None], list[np.ndarray]]:
        self._check_open()
        last_error: MooncakeError | None = None
        pending = list(range(len(keys)))
        metas: list[ObjectMeta | None] = [None] * len(keys)
        used: dict[int, Replica | None] = {}
        buffers: list[np.ndarray] = [np.empty(0, np.uint8)] * len(keys)
        for attempt in range(self.config.max_retries + 1):
            started = time.monotonic()
            result = self.index.lookup([keys[i] for i in pending], lease_ms=self.config.lease_ms)
            # Each lease runs at least 0.9 * lease_ms past now_ms (lookup.lua renews only shorter
            # ones); the reads are budgeted against the shortest one this batch got.
            lease_left_ms = min(
                (u - result.now_ms for u, m in zip(result.lease_until_ms, result.objects, strict=True) if m),
                default=self.config.lease_ms,
            )
            targets: list[tuple[int, ObjectMeta, memoryview]] = []
            for i, meta in zip(pending, result.objects, strict=True):
                metas[i] = meta
                if meta is None:
                    if not missing_ok:
                        raise KeyNotFound(f"key {keys[i]!r} not found (no complete replica on a live node)")
                    continue
                if dests is not None:
                    if len(dests[i]) < meta.size_bytes:
                        raise InvalidValue(f"out holds {len(dests[i])} B but key {keys[i]!r} is {meta.size_bytes} B")
                    dest = dests[i][: meta.size_bytes]
                else:
                    buffers[i] = np.empty(meta.size_bytes, dtype=np.uint8)
                    dest = memoryview(buffers[i]) if meta.size_bytes else memoryview(bytearray(0))
                targets.append((i, meta, dest))
            retry, error = self._read_targets(targets, used, refresh_nodes=attempt > 0)
            last_error = error or last_error
            done = [i for i, _, _ in targets if i not in retry]
            if done and time.monotonic() - started > LEASE_SAFETY * lease_left_ms / 1000:
                retry += self._outlived_lease(keys, metas, used, done)
            if not retry:
                return metas, buffers
            pending = sorted(retry)
        raise last_error or TransferError(
            f"could not read {len(pending)} key(s) (first {keys[pending[0]]!r}) after "
            f"{self.config.max_retries + 1} attempts: their replicas kept moving"
        )

    def _read_targets(
        self, targets: list[tuple[int, ObjectMeta, memoryview]], used: dict[int, Replica | None], *, refresh_nodes: bool
    ) -> tuple[list[int], MooncakeError | None]:
        """Read every target; returns the indexes to retry and the last error.

        Small objects whose cheapest path is TCP go out pipelined, one request train per agent, so a
        batch of N costs about one round trip instead of N. Everything else (shm copies, large
        objects that stripe, other tiers) is read one object at a time."""
        retry: list[int] = []
        error: MooncakeError | None = None
        nodes = self._node_table(refresh=refresh_nodes)
        trains: dict[str, list[tuple[int, Replica, ReadRequest]]] = {}
        singles: list[tuple[int, ObjectMeta, memoryview, tuple[Replica, NodeInfo, TransportKind] | None]] = []
        pipelined = len(targets) > 1
        stripe_bytes = self.config.stripe_bytes
        for i, meta, dest in targets:
            if meta.size_bytes == 0:
                used[i] = None
                continue
            best = self._best_replica(meta, nodes)
            if (
                pipelined
                and best is not None
                and best[2] == TransportKind.TCP
                and best[0].tier == TierKind.HOST
                and meta.size_bytes <= stripe_bytes
            ):
                replica, node, _ = best
                request = ReadRequest(alloc_id=replica.alloc_id, offset=replica.offset, dest=dest)
                trains.setdefault(node.tcp_endpoint, []).append((i, replica, request))
            else:
                singles.append((i, meta, dest, best))
        if trains:
            by_index = {i: (meta, dest) for i, meta, dest in targets}
            for endpoint, train in trains.items():
                try:
                    self._tcp.peer(endpoint).read_many([request for _, _, request in train])
                    for i, replica, _ in train:
                        used[i] = replica
                except (TransferError, ConnectError):
                    # Some object of the train moved or its agent failed: read those one by one,
                    # which tries every replica of each.
                    singles.extend((i, *by_index[i], None) for i, _, _ in train)
        for i, meta, dest, best in singles:
            try:
                used[i] = self._read_object(meta, dest, refresh_nodes=refresh_nodes, best=best)
            except (TransferError, ConnectError) as exc:
                error = exc
                retry.append(i)
        return retry, error

    def _best_replica(
        self, meta: ObjectMeta, nodes: dict[str, NodeInfo]
    ) -> tuple[Replica, NodeInfo, TransportKind] | None:
        """The cheapest replica and the path to it. For the common single-replica object the path
        to (node, tier) is remembered for as long as this copy of the node table is in use."""
        shm_reachable = self._reachable_segments(nodes)
        if len(meta.replicas) == 1:
            memo = getattr(self, "_route_memo", None)
            if memo is not None and memo[0] is nodes:
                replica = meta.replicas[0]
                route = memo[2].get((replica.node_id, replica.tier), False)
                if route is False:
                    first = order_replicas(
                        (replica,),
                        nodes,
                        allowed=self.transports,
                        host_id=self.host_id,
                        shm_names_reachable=shm_reachable,
                    )
                    route = (first[0][1], first[0][2]) if first else None
                    memo[2][(replica.node_id, replica.tier)] = route
                return None if route is None else (replica, route[0], route[1])
        ordered = order_replicas(
            meta.replicas, nodes, allowed=self.transports, host_id=self.host_id, shm_names_reachable=shm_reachable
        )
        return ordered[0] if ordered else None

    def _reachable_segments(self, nodes: dict[str, NodeInfo]) -> set[str]:
        """Same-host segments this client can map, worked out once per copy of the node table
        (kept with it, with the routes _best_replica remembers, in ``_route_memo``)."""
        memo = getattr(self, "_route_memo", None)
        if memo is not None and memo[0] is nodes:
            return memo[1]
        reachable = {
            n.shm_name for n in nodes.values() if n.host_id == self.host_id and self._shm.reachable(n.shm_name)
        }
        self._route_memo: tuple[dict[str, NodeInfo], set[str], dict[tuple[str, TierKind], Any]] = (
            nodes,
            reachable,
            {},
        )
        return reachable

    def _outlived_lease(
        self, keys: list[str], metas: list[ObjectMeta | None], used: dict[int, Replica | None], pending: list[int]
    ) -> list[int]:
        """A read that outlived its lease may have raced a free: keep only the objects that still
        list, unchanged, the replica the bytes came from (its memory cannot have been freed)."""
        check = [i for i in pending if metas[i] is not None and used.get(i) is not None]
        again = self.index.lookup([keys[i] for i in check], lease_ms=0)
        stale = []
        for i, now in zip(check, again.objects, strict=True):
            before, source = metas[i], used[i]
            if (
                now is None
                or before is None
                or source is None
                or now.version != before.version
                or not any(r.node_id == source.node_id and r.alloc_id == source.alloc_id for r in now.replicas)
            ):
                stale.append(i)
        return stale

    def _read_object(
        self,
        meta: ObjectMeta,
        dest: memoryview,
        *,
        refresh_nodes: bool,
        best: tuple[Replica, NodeInfo, TransportKind] | None = None,
    ) -> Replica | None:
        """Copy the object into ``dest`` from the cheapest replica that answers; returns that replica.
        ``best``, from _best_replica, spares ranking a single replica a second time."""
        if meta.size_bytes == 0:
            return None
        if best is not None and len(meta.replicas) == 1:
            ordered = [best]
        else:
            nodes = self._node_table(refresh=refresh_nodes)
            if any(r.node_id not in nodes for r in meta.replicas):
                nodes = self._node_table(refresh=True)
            ordered = order_replicas(
                meta.replicas,
                nodes,
                allowed=self.transports,
                host_id=self.host_id,
                shm_names_reachable=self._reachable_segments(nodes),
            )
        if not ordered:
            raise TransferError(
                f"no allowed transport {tuple(str(t) for t in self.transports)} reaches a replica of "
                f"{meta.key!r} (on {', '.join(r.node_id for r in meta.replicas)})"
            )
        errors: list[str] = []
        for replica, node, kind in ordered:
            try:
                if kind == TransportKind.SHM:
                    self._shm.read_into(node.shm_name, self._arena_bytes(node), replica.offset, dest)
                elif replica.tier == TierKind.HOST:
                    self._tcp.read_into(node.tcp_endpoint, replica.alloc_id, replica.offset, dest)
                else:
                    # The agent decodes other tiers whole: one request, no stripes.
                    self._tcp.peer(node.tcp_endpoint).read_many(
                        [ReadRequest(alloc_id=replica.alloc_id, offset=replica.offset, dest=dest)]
                    )
                if self.config.verify_checksum and checksum_of(dest) != meta.checksum:
                    raise TransferError(f"checksum mismatch reading {meta.key!r} from {node.node_id}")
                return replica
            except (TransferError, ConnectError) as exc:
                errors.append(f"{node.node_id} via {kind}: {exc}")
                if isinstance(exc, ConnectError):
                    self._tcp.drop_peer(node.tcp_endpoint)
        raise TransferError(f"every replica of {meta.key!r} failed: " + "; ".join(errors))

    # ---- other operations -------------------------------------------------------------------
    def object_meta(self, key: str) -> ObjectMeta | None:
        """Size, dtype, shape, checksum and readable replicas of ``key`` (None if absent); no lease."""
        self._check_open()
        return self.index.lookup([check_key(key)], lease_ms=0).objects[0]

    def exists(self, key: str) -> bool:
        """True when ``key`` has a complete replica on a live node (grants no lease)."""
        self._check_open()
        return self.index.lookup([check_key(key)], lease_ms=0).objects[0] is not None

    def remove(self, key: str) -> bool:
        """Remove ``key``; False when it was absent. Readers that already looked it up finish their
        reads (its memory is freed after their leases). Raises ObjectPinned while pinned."""
        return self.remove_many([key])[0]

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        statuses = self.index.remove([check_key(k) for k in keys])
        pinned = [k for k, s in zip(keys, statuses, strict=True) if s == "PINNED"]
        if pinned:
            raise ObjectPinned(f"key(s) {pinned[:5]!r} are pinned; release their pins first")
        return [s == 1 for s in statuses]

    def stat(self) -> ClusterStats:
        """Nodes with their tiers (capacity, used, objects), object count, bytes stored, hit counts."""
        self._check_open()
        nodes = self._node_table(refresh=True)
        objects, per_node, counters = self.index.counts(list(nodes))
        return build_stats(nodes, per_node, objects, counters, now_ms=self._server_now_ms())

    # ---- futures ----------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        self._check_open()
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.config.io_threads, thread_name_prefix="mc-io")
            return self._pool.submit(fn, *args, **kwargs)

    def get_async(self, key: str) -> Future[Any]:
        return self._submit(self.get, key)

    def get_into_async(self, key: str, out: object) -> Future[int]:
        return self._submit(self.get_into, key, out)

    def put_async(
        self, key: str, value: object, *, replicas: int = 1, preferred_node: str | None = None
    ) -> Future[None]:
        return self._submit(self.put, key, value, replicas=replicas, preferred_node=preferred_node)


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
        overrides["client.transports"] = ",".join(transports) if not isinstance(transports, str) else transports
    config = load_config(file=config_file, overrides=overrides)
    if not config.redis_url:
        raise ConnectError(
            "no cluster to connect to: pass a Redis URL to connect(), set MOONCAKE_REDIS_URL, or start "
            "one with `mooncake up` or `with LocalCluster() as cluster: connect(cluster.redis_url)`"
        )
    return Client(config.redis_url, namespace=config.namespace, config=config.client)
