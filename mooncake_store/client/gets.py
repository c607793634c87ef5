"""The read path of the client: one lookup with a lease per batch, then the bytes from the
cheapest replica of each object (a memcpy from a same-host arena, pipelined TCP request trains per
agent for small objects, striped TCP for large ones, the agent for other tiers), and a check
against the index for any read that outlived its lease (DESIGN.md §3.3)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mooncake_store.client.buffers import Destination, check_fill_dtype, host_buffer
from mooncake_store.client.lease_clock import lease_clock_s
from mooncake_store.client.replica_writes import checksum_of
from mooncake_store.errors import (
    AgentBusy,
    ConnectError,
    InvalidValue,
    KeyNotFound,
    MooncakeError,
    TransferError,
    TransferTimeout,
)
from mooncake_store.policy.transport_choice import gpu_ipc_node, order_replicas
from mooncake_store.transport.tcp import ReadRequest
from mooncake_store.types import NodeInfo, ObjectMeta, Replica, TierKind, TransportKind, shown_key, stale_for

if TYPE_CHECKING:
    from mooncake_store.client.client import Client
    from mooncake_store.index.client import LookupResult

#: Re-check a read against the index when it ends within this fraction of its lease.
LEASE_SAFETY = 0.8

#: Per thread: whether its reads are a caller's second try at keys it already read (see
#: uncounted), and how many keys its lookups have counted (see counted_keys).
_again = threading.local()


#: Why a read gave up after its attempts: each read of the object outlived its lease and found it
#: moved, or replaced or removed, by the time it looked again (the index says no more than that).
RACED = "each read outlived its lease and found the object moved, replaced or removed meanwhile"


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """The calling thread's reads in the block count no hits or misses in stat(): they try again
    keys a read before them counted (a PrefixCache's per-chunk fallback after its batch read
    failed, the CLI's get after the object changed size), as a read's own retries count nothing."""
    before = getattr(_again, "on", False)
    _again.on = True
    try:
        yield
    finally:
        _again.on = before


def lookup(client: Client, keys: list[str], attempt: int) -> LookupResult:
    """A read's lookup of ``keys`` with a lease, counted in stat() on the read's first ``attempt``
    only and not inside uncounted(); what it counted is noted for counted_keys()."""
    counted = attempt == 0 and not getattr(_again, "on", False)
    result = client.index.lookup(keys, lease_ms=client.config.lease_ms, counted=counted)
    if counted:
        _again.counted = counted_keys() + len(keys)
    return result


def counted_keys() -> int:
    """Keys the calling thread's lookups have counted so far: a caller that reads keys again after
    a failed read knows from it whether that read's lookup counted them (it may have failed before
    its lookup ran, on a connection to the index)."""
    return int(getattr(_again, "counted", 0))


def refuse_stale_shm(key: str, replica: Replica, node: NodeInfo, kind: TransportKind) -> None:
    """TransferError (the caller looks the key up again) for a shm copy of a replica handed out by
    an earlier incarnation of its node (the table was read afresh for it: Client._nodes_for): its
    offset means nothing in the new arena, and no agent is there to refuse it, as one does over TCP."""
    if kind == TransportKind.SHM and stale_for(replica, node):
        raise TransferError(
            f"the replica of {key!r} on {node.node_id} was handed out by an earlier incarnation of that "
            "node, restarted since the lookup"
        )


class GetPath:
    def __init__(self, client: Client) -> None:
        self.client = client
        self._route_memo: Any = None  # (node table, reachable segments, routes) of the last table seen
        self._cuda_here: bool | None = None  # whether this process can use CUDA (asked once)

    def get_batch(
        self, keys: list[str], dests: list[Destination] | None, *, missing_ok: bool
    ) -> tuple[list[ObjectMeta | None], list[np.ndarray]]:
        try:
            return self._get_batch(keys, dests, missing_ok=missing_ok)
        except MooncakeError as exc:
            # Cut short by close(): "client is closed", not the transfer error the close caused.
            self.client._raise_if_interrupted(exc)
            raise

    def _get_batch(
        self, keys: list[str], dests: list[Destination] | None, *, missing_ok: bool
    ) -> tuple[list[ObjectMeta | None], list[np.ndarray]]:
        last_error: MooncakeError | None = None
        pending = list(range(len(keys)))
        metas: list[ObjectMeta | None] = [None] * len(keys)
        used: dict[int, Replica | None] = {}
        buffers: list[np.ndarray] = [np.empty(0, np.uint8)] * len(keys)
        # Agent endpoints that failed (timed out, refused) during this call: not asked again by it,
        # so a stalled agent costs the batch one timeout, not one per key and attempt.
        failing: dict[str, MooncakeError] = {}  # endpoint -> what it answered
        for attempt in range(self.client.config.max_retries + 1):
            self.client._check_open()  # a retry after close() cut this call's reads short: none
            started = lease_clock_s()  # counts a suspend of this host, as the lease does
            # Counted once per key and call: a retry's keys were counted by the first lookup.
            result = lookup(self.client, [keys[i] for i in pending], attempt)
            # Each lease runs at least 0.9 * lease_ms past now_ms (lookup.lua renews only shorter
            # ones); the reads are budgeted against the shortest one this batch got.
            lease_left_ms = result.lease_left_ms(self.client.config.lease_ms)
            targets: list[tuple[int, ObjectMeta, memoryview]] = []
            for i, meta in zip(pending, result.objects, strict=True):
                metas[i] = meta
                if meta is None:
                    if not missing_ok:
                        raise KeyNotFound(
                            f"key {shown_key(keys[i])} not found (no complete replica on a live node)", key=keys[i]
                        )
                    continue
                if dests is not None:
                    out = dests[i]
                    which = f"outs[{i}]" if len(keys) > 1 else "out"  # which, with a key given twice
                    try:
                        check_fill_dtype(keys[i], meta.dtype, out.dtype)
                        if len(out.view) < meta.size_bytes:
                            size = meta.size_bytes
                            raise InvalidValue(f"{which} holds {len(out.view)} B but key {keys[i]!r} is {size} B")
                    except InvalidValue as refused:
                        if attempt > 0:
                            # Read again (its lease ran short, a replica failed; every key of a
                            # retry was read into before) and found replaced by one the destination
                            # cannot hold: the refusal comes after a write.
                            refused.args = (
                                f"{refused}; it was replaced by that object while it was read, and {which} "
                                "holds what was read of the one before",
                            )
                        raise
                    dest = out.view[: meta.size_bytes]
                else:
                    buffers[i] = host_buffer(keys[i], meta.size_bytes)
                    dest = memoryview(buffers[i]) if meta.size_bytes else memoryview(bytearray(0))
                targets.append((i, meta, dest))
            retry, error = self._read_targets(targets, used, refresh_nodes=attempt > 0, failing=failing)
            last_error = error or last_error
            done = [i for i, _, _ in targets if i not in retry]
            if done and lease_clock_s() - started > LEASE_SAFETY * lease_left_ms / 1000:
                retry += self.outlived_lease(keys, metas, used, done)
            if not retry:
                return metas, buffers
            pending = sorted(retry)
        raise last_error or TransferError(
            f"could not read {len(pending)} key(s) (first {keys[pending[0]]!r}) after "
            f"{self.client.config.max_retries + 1} attempts (max_retries={self.client.config.max_retries}): "
            f"{RACED} (lease_ms={self.client.config.lease_ms})"
        )

    def _read_targets(
        self,
        targets: list[tuple[int, ObjectMeta, memoryview]],
        used: dict[int, Replica | None],
        *,
        refresh_nodes: bool,
        failing: dict[str, MooncakeError],
    ) -> tuple[list[int], MooncakeError | None]:
        """Read every target; returns the indexes to retry and the last error.

        Small objects whose cheapest path is TCP go out pipelined, one request train per agent, so a
        batch of N costs about one round trip instead of N. Everything else (shm copies, large
        objects that stripe, other tiers) is read one object at a time."""
        retry: list[int] = []
        error: MooncakeError | None = None
        nodes = self.client._nodes_for(
            (r for _, meta, _ in targets for r in meta.replicas), self.client._node_table(refresh=refresh_nodes)
        )
        trains: dict[str, list[tuple[int, Replica, ReadRequest]]] = {}
        singles: list[tuple[int, ObjectMeta, memoryview, tuple[Replica, NodeInfo, TransportKind] | None]] = []
        pipelined = len(targets) > 1
        stripe_bytes = self.client.config.stripe_bytes
        for i, meta, dest in targets:
            if meta.size_bytes == 0:
                used[i] = None
                continue
            best = self._best_replica(meta, nodes)
            if (
                pipelined
                and best is not None
                and best[1].tcp_endpoint not in failing
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
                    self.client._tcp.peer(endpoint).read_many([request for _, _, request in train])
                    for i, replica, request in train:
                        meta = by_index[i][0]
                        if self._corrupt(meta, request.dest):
                            singles.append((i, meta, request.dest, None))  # every replica, or the error
                            continue
                        used[i] = replica
                except (TransferError, ConnectError) as exc:
                    # Some object of the train moved or its agent failed: read those one by one,
                    # which tries every replica of each.
                    if isinstance(exc, TransferTimeout | AgentBusy):
                        failing[endpoint] = exc
                    singles.extend((i, *by_index[i], None) for i, _, _ in train)
        for i, meta, dest, best in singles:
            try:
                used[i] = self._read_object(meta, dest, refresh_nodes=refresh_nodes, best=best, failing=failing)
            except (TransferError, ConnectError) as exc:
                error = exc
                retry.append(i)
        return retry, error

    def _order(
        self, replicas: Sequence[Replica], nodes: dict[str, NodeInfo], shm_reachable: set[str]
    ) -> list[tuple[Replica, NodeInfo, TransportKind]]:
        """order_replicas with what this client can do: its transports, the segments it can map,
        and (asked only when a GPU replica is in question) whether it can use CUDA IPC."""
        return order_replicas(
            replicas,
            nodes,
            allowed=self.client.transports,
            host_id=self.client.host_id,
            shm_names_reachable=shm_reachable,
            cuda_ipc=self._ipc_in_question(replicas, nodes) and self._cuda_usable(),
        )

    def _ipc_in_question(self, replicas: Sequence[Replica], nodes: dict[str, NodeInfo]) -> bool:
        """Whether CUDA IPC could reach one of ``replicas`` at all (shm allowed, a same-host GPU
        replica with a handle): only then is CUDA probed, which imports cupy and starts the CUDA
        runtime in this process."""
        client = self.client
        return TransportKind.SHM in client.transports and any(
            r.tier == TierKind.GPU and (node := nodes.get(r.node_id)) is not None and gpu_ipc_node(node, client.host_id)
            for r in replicas
        )

    def _cuda_usable(self) -> bool:
        """Whether this process can use CUDA, so copy a same-host agent's GPU replica through the
        arena's IPC handle (one device-to-host copy instead of the agent's copy and a TCP
        transfer). Only in a process that already uses cupy: opening the handle would otherwise
        give a CPU-only reader a CUDA context (hundreds of MiB of device memory) for a host read.
        Asked once cupy is there."""
        if self._cuda_here is None:
            if "cupy" not in sys.modules:
                return False
            from mooncake_store.tiers.gpu_arrays import cuda_status  # imports cupy lazily

            self._cuda_here = cuda_status(0)[0]
        return self._cuda_here

    def _best_replica(
        self, meta: ObjectMeta, nodes: dict[str, NodeInfo]
    ) -> tuple[Replica, NodeInfo, TransportKind] | None:
        """The cheapest replica and the path to it. For the common single-replica object the path
        to (node, tier) is remembered for as long as this copy of the node table is in use."""
        shm_reachable = self._reachable_segments(nodes)
        if len(meta.replicas) == 1:
            memo = self._route_memo
            if memo is not None and memo[0] is nodes:
                replica = meta.replicas[0]
                route = memo[2].get((replica.node_id, replica.tier), False)
                if route is False:
                    first = self._order((replica,), nodes, shm_reachable)
                    route = (first[0][1], first[0][2]) if first else None
                    memo[2][(replica.node_id, replica.tier)] = route
                return None if route is None else (replica, route[0], route[1])
        ordered = self._order(meta.replicas, nodes, shm_reachable)
        return ordered[0] if ordered else None

    def _reachable_segments(self, nodes: dict[str, NodeInfo]) -> set[str]:
        """Same-host segments this client can map, worked out once per copy of the node table
        (kept with it, with the routes _best_replica remembers, in ``_route_memo``)."""
        memo = self._route_memo
        if memo is not None and memo[0] is nodes:
            return memo[1]
        reachable = {
            n.shm_name
            for n in nodes.values()
            if n.host_id == self.client.host_id and self.client._shm.reachable(n.shm_name)
        }
        self._route_memo = (
            nodes,
            reachable,
            {},
        )
        return reachable

    def _read_via_agent(self, node: NodeInfo, replica: Replica, dest: memoryview) -> None:
        # The agent copies other tiers out whole (device to host, or decoding a file): one request.
        self.client._tcp.peer(node.tcp_endpoint).read_many(
            [ReadRequest(alloc_id=replica.alloc_id, offset=replica.offset, dest=dest)]
        )

    def _read_gpu_ipc(self, node: NodeInfo, replica: Replica, dest: memoryview) -> None:
        from mooncake_store.tiers.gpu_arrays import host_pointer

        try:
            self.client._gpu_segments().read(node, replica, host_pointer(dest), len(dest))
        except TransferError:
            # The handle would not open here (remembered): through the agent, if TCP is allowed;
            # else the error sends _read_object on to the next replica.
            if TransportKind.TCP not in self.client.transports:
                raise
            self._read_via_agent(node, replica, dest)

    def _unreachable_because(self, replica: Replica, node: NodeInfo | None) -> str:
        """Why none of this client's transports reaches ``replica`` (shm alone, as tcp reaches every
        live agent): a disk replica is served by its agent only, over tcp, and a get over shm
        never asks the agent, so it is not promoted back to memory either."""
        where = f"{replica.node_id}'s {replica.tier} tier"
        if replica.tier == TierKind.DISK:
            return f"{where}: a disk tier is read by its agent only, over tcp"
        if node is None:
            return f"{where}: its node is no longer in the node table (gone since the lookup)"
        if node.host_id != self.client.host_id:
            return f"{where}: on another host, which shm does not reach"
        return f"{where}: its segment cannot be mapped here"

    def _corrupt(self, meta: ObjectMeta, dest: memoryview) -> bool:
        """With verify_checksum, whether the bytes read differ from what was put. Device puts
        record no checksum (0): hashing would cost a device-to-host copy."""
        return bool(self.client.config.verify_checksum and meta.checksum and checksum_of(dest) != meta.checksum)

    def _read_shm(self, node: NodeInfo, replica: Replica, dest: memoryview) -> None:
        """A host replica out of its agent's shared arena; over TCP from the same agent when this
        process cannot map the arena (no room in its address space, no descriptor left), as the
        agents' own peer mappings fall back."""
        client = self.client
        try:
            client._shm.read_into(node.shm_name, client._arena_bytes(node), replica.offset, dest)
        except ConnectError:  # the mapping's failure: a copy out of a mapped arena raises none
            if TransportKind.TCP not in client.transports:
                raise
            client._tcp.read_into(node.tcp_endpoint, replica.alloc_id, replica.offset, dest)

    def outlived_lease(
        self, keys: list[str], metas: list[ObjectMeta | None], used: dict[int, Replica | None], pending: list[int]
    ) -> list[int]:
        """A read that outlived its lease may have raced a free: keep only the objects that still
        list, unchanged, the replica the bytes came from (its memory cannot have been freed)."""
        check = [i for i in pending if metas[i] is not None and used.get(i) is not None]
        again = self.client.index.lookup([keys[i] for i in check], lease_ms=0)
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
        failing: dict[str, MooncakeError] | None = None,
    ) -> Replica | None:
        """Copy the object into ``dest`` from the cheapest replica that answers; returns that replica.
        ``best``, from _best_replica, spares ranking a single replica a second time. ``failing``:
        agent endpoints that failed earlier in the batch, not asked again (and added to here)."""
        if meta.size_bytes == 0:
            return None
        nodes: dict[str, NodeInfo] = {}
        if best is not None and len(meta.replicas) == 1:
            ordered = [best]
        else:
            nodes = self.client._nodes_for(meta.replicas, self.client._node_table(refresh=refresh_nodes))
            ordered = self._order(meta.replicas, nodes, self._reachable_segments(nodes))
        if failing:
            skipped = [r for r in ordered if r[2] != TransportKind.SHM and r[1].tcp_endpoint in failing]
            ordered = [r for r in ordered if r not in skipped]
            if not ordered and skipped:
                causes = {r[1].node_id: failing[r[1].tcp_endpoint] for r in skipped}
                why = "; ".join(f"{node_id}: {exc}" for node_id, exc in sorted(causes.items()))
                message = f"every replica of {meta.key!r} is on an agent that failed earlier in this call: {why}"
                # Agents that are merely full of connections are no failed transfer: say so by type.
                if all(isinstance(exc, AgentBusy) for exc in causes.values()):
                    raise AgentBusy(message)
                raise TransferError(message)
        if not ordered:
            allowed = self.client.transports
            if TransportKind.SHM in allowed:
                why = [self._unreachable_because(r, nodes.get(r.node_id)) for r in meta.replicas]
            else:  # neither of the two built paths: no replica is the reason
                why = ["shm is not allowed", "tcp is not allowed"]
                if TransportKind.RDMA in allowed:
                    why.append("rdma is not built yet (README, Not built yet)")
            raise TransferError(
                f"no allowed transport {tuple(str(t) for t in allowed)} reaches a replica of {meta.key!r}: "
                + "; ".join(why)
            )
        errors: list[str] = []
        for replica, node, kind in ordered:
            try:
                refuse_stale_shm(meta.key, replica, node, kind)
                if kind == TransportKind.SHM and replica.tier == TierKind.GPU:
                    self._read_gpu_ipc(node, replica, dest)
                elif kind == TransportKind.SHM:
                    self._read_shm(node, replica, dest)
                elif replica.tier == TierKind.HOST:
                    self.client._tcp.read_into(node.tcp_endpoint, replica.alloc_id, replica.offset, dest)
                else:
                    self._read_via_agent(node, replica, dest)
                if self._corrupt(meta, dest):
                    raise TransferError(f"checksum mismatch reading {meta.key!r} from {node.node_id}")
                return replica
            except (TransferError, ConnectError) as exc:
                errors.append(f"{node.node_id} via {kind}: {exc}")
                self.client._tcp.drop_peer_after(node.tcp_endpoint, exc)
                # An agent that timed out, or turned us away at its connection limit, is not asked
                # again for the rest of the call: each key would cost it another accept and refusal.
                if failing is not None and kind != TransportKind.SHM and isinstance(exc, TransferTimeout | AgentBusy):
                    failing[node.tcp_endpoint] = exc
        raise TransferError(f"every replica of {meta.key!r} failed: " + "; ".join(errors))
