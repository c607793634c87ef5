"""The write path of the client: the two-phase put (DESIGN.md §3.2) for a batch of objects.

reserve on the chosen agents (one RESERVE frame per agent) → PENDING records (one index round
trip) → bytes (a memcpy into a same-host arena, a device-to-device copy into a same-host GPU tier,
or TCP) → commit (one index round trip). Anything that fails after the reservation is undone by
:meth:`PutPath.abandon`, which can never free a live object. Where the replicas go, and the
RESERVE frames, are client/reserving.py's; the bytes are moved by client/replica_writes.py.

The checksum a put commits is taken of its bytes where they landed, not of the caller's value:
the value is read in place, and a caller that changes it while the put runs must still get an
object that every verifying read accepts (its old bytes, its new ones, or a mix of both), never
one whose checksum describes bytes that were not stored. A same-host copy hashes the arena piece
by piece right after copying it (transport/shm.py copy_and_hash); over TCP the agent hashes what
it received (DIGEST, sent behind the WRITE). Hashing each piece before sending it would leave a
change between the hash and the send undetected, and sending from a copy of the value would add a
pass over the data; either way the put makes one hashing pass over its bytes, as when it hashed
its source. Replicas written from a value that changed between their copies differ, and no single
checksum describes them: that put fails (InvalidValue) and stores nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

from mooncake_store.client.buffers import Source, as_source
from mooncake_store.client.put_plans import PlannedPut, check_chain_meta
from mooncake_store.client.replica_writes import FencedPart, ReplicaWriteFailed, ReplicaWriter, failing_node
from mooncake_store.client.reserving import Reserver
from mooncake_store.errors import (
    InvalidValue,
    MooncakeError,
    NoCapacity,
    ObjectPinned,
    ProtocolError,
    ReservationExpired,
)
from mooncake_store.index.client import IndexSilent
from mooncake_store.policy.placement import tier_capacity, waited_for_room
from mooncake_store.policy.transport_choice import gpu_ipc_node
from mooncake_store.tiers.gpu_arrays import is_device_array
from mooncake_store.transport.cancel import current_cancel, running_under
from mooncake_store.types import NodeInfo, Replica, TierKind, TransportKind, check_key, shown_key

if TYPE_CHECKING:
    from mooncake_store.client.client import Client
    from mooncake_store.client.device import DeviceSource

log = logging.getLogger("mooncake.client")

#: How long a put waits for its first choice to make room before it asks one more node (reserving.py).
WIDEN_ROOM_ASK_S = 1.0


class PutPath:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.writes = ReplicaWriter(client)
        self.reserver = Reserver(client, self.abandon)

    # ---- planning ---------------------------------------------------------------------------
    def plan(
        self,
        items: Mapping[str, object],
        *,
        chain_pos: Mapping[str, int] | None,
        chain_parent: Mapping[str, str] | None,
        preferred_node: str | None = None,
        replicas: int = 1,
    ) -> list[PlannedPut]:
        plans = []
        check_chain_meta(items, chain_pos, chain_parent)
        # The GPU tier is reached through CUDA IPC, a same-host path like shm: a client told not
        # to use shm stages device arrays to host memory instead. Read once, for device arrays only.
        gpu_nodes = (
            [
                n
                for n in self.client._node_table().values()
                if TransportKind.SHM in self.client.transports
                and gpu_ipc_node(n, self.client.host_id)
                and preferred_node in (None, n.node_id)
            ]
            if any(is_device_array(value) for value in items.values())
            else []
        )
        for key, value in items.items():
            check_key(key)
            try:
                source, tier = self._source_of(value, replicas, gpu_nodes)
            except InvalidValue as exc:
                if len(items) == 1:
                    raise
                # In a batch, which value: "array of shape (5,) is not C-contiguous" said nothing
                # of which of fifty.
                raise type(exc)(f"{shown_key(key)}: {exc}") from None
            plans.append(
                PlannedPut(
                    key=key,
                    source=source,
                    put_id=uuid.uuid4().bytes,
                    chain_pos=(chain_pos or {}).get(key),
                    chain_parent=(chain_parent or {}).get(key),
                    tier=tier,
                )
            )
        return plans

    def _source_of(
        self, value: object, replicas: int, gpu_nodes: list[NodeInfo]
    ) -> tuple[Source | DeviceSource, TierKind]:
        """The bytes of ``value`` as a put reads them, and the tier they go to."""
        if not is_device_array(value):
            return as_source(value), TierKind.HOST
        from mooncake_store.client import device  # lazy: only device arrays need it

        dev = device.as_device_source(value)
        # Into GPU tiers that can hold it at all, one per replica; else staged to host memory
        # once, as on a host without a GPU tier (too large for every GPU arena, a preferred node
        # without one, or fewer such tiers than replicas is no reason to fail).
        holders = sum(tier_capacity(n, TierKind.GPU) >= dev.size_bytes for n in gpu_nodes)
        if holders >= replicas:
            return dev, TierKind.GPU
        return as_source(device.to_host(dev)), TierKind.HOST  # no GPU tier here: stage once to host

    def run(self, plans: list[PlannedPut], *, replicas: int, preferred_node: str | None) -> None:
        # Space held by removed or replaced objects comes back once their read leases run out, so a
        # full cluster is worth waiting for, up to timeout_s; an object larger than every arena is not.
        config = self.client.config
        deadline = time.monotonic() + config.timeout_s
        expired_tries = failed_writes = 0
        fresh_table_tried = node_gone = False
        delay_s = 0.05
        first_wait: float | None = None  # when this put first waited for room
        stored: list[str] = []  # keys an earlier attempt of this batch stored (no retry writes them)
        while True:
            try:
                # One more node that refused is asked to make room (reserving.py) for each
                # WIDEN_ROOM_ASK_S the put has waited: time for the first choice's pressure pass
                # and the reclaim after it. Widened at each wait (the first is 50 ms), a put that
                # a pass of many small evictions took longer for made room on every node.
                waited = 0.0 if first_wait is None else time.monotonic() - first_wait
                room_asks = 1 + int(waited / WIDEN_ROOM_ASK_S)
                self._put_once(plans, replicas, preferred_node, room_asks=room_asks, stored=stored)
                return
            except ReplicaWriteFailed as failed:
                # The attempt was abandoned; its agent died or broke after granting the room. Place
                # the put again without that node, as often as max_retries allows; never without
                # the node the caller pinned it to.
                self.client._raise_if_interrupted(failed.error)
                failed_writes += 1
                if failed.node_id == preferred_node or failed_writes > config.max_retries:
                    raise failed.error from None
                for plan in plans:
                    plan.avoid.add(failed.node_id)
                others = [n for n in self.client._node_table(refresh=True) if n not in plans[0].avoid]
                if len(others) < replicas:  # nowhere else to go: the failure is the answer
                    raise failed.error from None
                log.info(
                    "put of %s: %s failed a write (%s); placing it again", plans[0].key, failed.node_id, failed.error
                )
            except MooncakeError as exc:
                # Cut short by close(): "client is closed", not the transfer error the close caused
                # (the attempt was abandoned, as every failed one is, before this saw it).
                self.client._raise_if_interrupted(exc)
                # A node of this put vanished from the table (it died, or the index restarted
                # empty and forgot every node until their next heartbeats, about a second): the
                # table is in flux, and until timeout_s a fresh one is waited for, as room is.
                node_gone = node_gone or (isinstance(exc, ReservationExpired) and exc.node_gone)
                settling = node_gone and isinstance(exc, ReservationExpired | NoCapacity)
                # Or every registered node is past its deadline: after an index outage longer than
                # a TTL every one is, until the first heartbeat back.
                # Or none at all where there were some: the index restarted empty, and forgot every
                # node until its next heartbeat (a put failed at once, "no live agent is registered").
                settling = settling or (fresh_table_tried and isinstance(exc, NoCapacity) and self._in_flux())
                if isinstance(exc, ReservationExpired) and not exc.node_gone:
                    expired_tries += 1
                    if expired_tries > config.max_retries:
                        raise
                elif isinstance(exc, NoCapacity) and exc.permanent and not fresh_table_tried:
                    # Judged on the cached node table (up to NODE_TABLE_TTL_S old, against agents
                    # that heartbeat about as often): a live node could look past its deadline, and
                    # "replicas=2 needs 2 live nodes" be said with two of them up. Once more, afresh.
                    fresh_table_tried = True
                    self.client._node_table(refresh=True)
                elif (
                    settling or (isinstance(exc, NoCapacity) and not exc.permanent)
                ) and time.monotonic() + delay_s <= deadline:
                    if self.client._closing.wait(delay_s):  # close() ends the wait for room too
                        self.client._check_open()
                    # Nodes come back at their next heartbeat: looked for four times a second.
                    delay_s = min(delay_s * 2, 0.25 if settling else 1.0)
                    first_wait = time.monotonic() if first_wait is None else first_wait
                    self.client._node_table(refresh=True)
                elif isinstance(exc, NoCapacity) and not exc.permanent:
                    raise NoCapacity(
                        f"{exc}; {waited_for_room(config.timeout_s)}",
                        free_bytes=exc.free_bytes,
                        largest_bytes=exc.largest_bytes,
                    ) from None
                elif settling and isinstance(exc, NoCapacity):
                    waited = f"waited {config.timeout_s:g} s (timeout_s) for the nodes to register again"
                    raise NoCapacity(f"{exc}; {waited}", permanent=exc.permanent, batch_limit=exc.batch_limit) from None
                else:
                    raise
            for plan in plans:
                plan.put_id = uuid.uuid4().bytes
                plan.replicas = []
                plan.assigned = set()
                plan.landed = []

    def _in_flux(self) -> bool:
        """Every registered node past its deadline (an index outage longer than a TTL: the first
        heartbeat back gives each node its grace again, index-side), or an empty table where nodes
        were seen before and the index has recorded no heartbeat since (it restarted; agents that
        were stopped leave their last heartbeat recorded, and a put fails at once), or a node seen
        before gone from the table while its deadline still ran, and not by a purge: the index
        restarted empty and some of its agents are registered again, not all (a replicas=2 put
        then failed at once, "only 1 qualify", a second before the other was back). One dead node
        among live ones is no flux: the put fails at once, naming it, as the README says (it
        waited for the node's reap, then failed without naming it)."""
        nodes = self.client._node_table()  # first: a read of it sets the clock offset
        view = self.client._view
        if not nodes and view.seen_nodes and not self.client.index.heartbeat_recorded():
            return True
        now = self.client._server_now_ms()
        if nodes and all(n.heartbeat_deadline_ms < now for n in nodes.values()):
            return True
        # Also an empty table after a heartbeat was recorded: an agent's beat that found its record
        # gone lands before its registration, a separate call (a put in between failed at once).
        vanished = [node for node, deadline in view.deadlines.items() if node not in nodes and deadline >= now]
        return bool(self.client.index.forgotten(vanished))

    # ---- one attempt ------------------------------------------------------------------------
    def _put_once(
        self,
        plans: list[PlannedPut],
        replicas: int,
        preferred_node: str | None,
        *,
        room_asks: int = 1,
        stored: list[str],
    ) -> None:
        client = self.client
        # The reservations' ids name the incarnation that granted them: a node restarted since this
        # copy of the table was read has a new arena under a new name, to be written through.
        reserved_by = self.reserver.reserve(plans, replicas, preferred_node, room_asks=room_asks)
        nodes = client._nodes_for((r for p in plans for r in p.replicas), reserved_by)
        with contextlib.ExitStack() as counted:
            try:
                counted.enter_context(client._in_flight.entered())  # close() waits for its index work
            except MooncakeError:
                self.abandon(plans, nodes, started=False)  # closed meanwhile: its room goes back
                raise
            self._put_started(plans, nodes, client, stored)

    def _put_started(
        self, plans: list[PlannedPut], nodes: dict[str, NodeInfo], client: Client, stored: list[str]
    ) -> None:
        """The rest of one attempt, from put_start to the commit (or the revoke of what it
        abandoned), counted in by _put_once. ``stored``: the keys of the batch earlier attempts
        stored, to which this one adds those it stores when others fail (each error names them)."""
        started = False
        index_silent = False  # put_commit got no answer: a revoke would wait out timeout_s again
        fences: list[FencedPart] = []
        try:
            same_host: dict[str, list[tuple[Replica, PlannedPut]]] = {}
            elsewhere: list[tuple[Replica, PlannedPut]] = []
            for plan in plans:
                for replica in plan.replicas:
                    node = nodes[replica.node_id]
                    if (
                        plan.size_bytes
                        and isinstance(plan.source, Source)
                        and client._use_shm(node)
                        and self.writes.arena_mapped(node)
                    ):
                        same_host.setdefault(node.node_id, []).append((replica, plan))
                    else:
                        elsewhere.append((replica, plan))
            # The FENCEs go out first and their replies are read after put_start's round trip.
            for node_id, group in same_host.items():
                # Its agent may have died since it granted the room: a write failure of that node,
                # placed again without it, as a TCP write's is (a bare ConnectError ended the put).
                with failing_node(node_id):
                    fences += self.writes.fence(nodes[node_id], group)
            client.index.put_start([p.pending() for p in plans], ttl_ms=int(client.config.timeout_s * 1000 * 3))
            started = True
            for replica, plan in elsewhere:
                with failing_node(replica.node_id):
                    self.writes.write_replica(nodes[replica.node_id], replica, plan)
            for part in fences:
                with failing_node(part.node.node_id):
                    self.writes.copy_fenced(part)
                    part.fence.unfence()
            # Every UNFENCE is out before the first reply is read (agents answer in parallel), and
            # every reply is read before put_commit: a reservation the agent freed while it was
            # fenced must not be committed. The index alone would not refuse it: a sync that ran
            # before put_start (a writer that stalled) found no pending record to revoke ("G") and
            # freed the reservation, and the pending record written after it is then committed.
            for part in fences:
                with failing_node(part.node.node_id):
                    self.writes.check_landed(part)
            checksums = [p.checksum() for p in plans]
            # Not after close(): it cut the transfers of others, and this one must not be the
            # exception because its bytes were already out (client/in_flight.py).
            client._in_flight.check()
            try:
                statuses = client.index.put_commit([p.put_id.hex() for p in plans], checksums=checksums)
            except IndexSilent:  # not a refused connection, which a revoke meets at once too
                index_silent = True
                raise
        except BaseException as exc:
            for part in fences:
                part.fence.abort()  # closing the connection lifts its fences
            # An index that did not answer the commit is not asked to revoke: the put failed after
            # twice timeout_s, not once. The agents' syncs revoke the pending records of the
            # reservations they expire (asked to below, or at their timeout) when it answers again.
            failed_node = exc.node_id if isinstance(exc, ReplicaWriteFailed) else None
            self.abandon(plans, nodes, started=started and not index_silent, failed_node=failed_node)
            raise
        failed = [(p, s) for p, s in zip(plans, statuses, strict=True) if s != "OK"]
        if failed:
            self.abandon([p for p, _ in failed], nodes, started=True)
            # The batch's other puts did land (in this attempt or an earlier one): say which, so that
            # a retry need not write them again.
            stored += [p.key for p, s in zip(plans, statuses, strict=True) if s == "OK"]
            # And run()'s own retry (of expired reservations) writes only those that failed: it
            # wrote the stored ones again, over what another writer had put there meanwhile, and
            # failed on one pinned meanwhile.
            plans[:] = [p for p, _ in failed]
            landed = f"; stored the other {len(stored)} key(s): {stored[:5]!r}" if stored else ""
            loop = next((p for p, s in failed if s == "LOOP"), None)
            if loop is not None:
                raise InvalidValue(
                    f"chain_parent of {loop.key!r} is {loop.chain_parent!r}, out of order with the chunks stored: "
                    f"chain positions grow from parent to child, and {loop.chain_pos} is not after "
                    f"{loop.chain_parent!r}'s or not before that of a stored child of {loop.key!r} (out of order, "
                    "links could loop, and no chunk of a loop could ever be evicted)" + landed
                )
            malformed = [f"o:{p.key}" for p, s in failed if s == "MALFORMED"]
            malformed += [f"the chain parent child count for {p.key!r}" for p, s in failed if s == "BAD_COUNT"]
            if malformed:
                raise ProtocolError(
                    f"cannot commit, since their index records are malformed (written by hand or by another "
                    f"build; left as they are): {malformed[:5]!r}" + landed
                )
            pinned = [p.key for p, s in failed if s == "PINNED"]
            if pinned:
                raise ObjectPinned(
                    f"cannot replace pinned key(s) {pinned[:5]!r}: release their pins first" + landed,
                    pinned=pinned,
                    done=list(stored),
                )
            gone = [p.key for p, s in failed if s == "GONE"]
            if gone:
                raise ReservationExpired(
                    f"{len(gone)} put(s) reserved on a node that left the node table, missed its heartbeat "
                    f"deadline or restarted since (an index restarted empty knows no node until its next "
                    f"heartbeat; first key {gone[0]!r})" + landed,
                    node_gone=True,
                )
            raise ReservationExpired(
                f"{len(failed)} put(s) outlived the agent's reservation timeout and were reclaimed "
                f"(first key {failed[0][0].key!r})" + landed
            )

    def abandon(
        self, plans: list[PlannedPut], nodes: dict[str, NodeInfo], *, started: bool, failed_node: str | None = None
    ) -> None:
        """Undo puts that will not commit: drop their pending records, then ask the agents to expire
        the reservations now. Each agent frees them at its next sync unless a commit did reach the
        index (the writer may have lost only the reply), so this can never free a live object.
        ``failed_node``: the node whose write failed. It is asked on a thread of its own, since a
        stalled agent (the write timed out) would hold this put up for another timeout_s."""
        client = self.client
        by_node: dict[str, list[int]] = {}
        for plan in plans:
            for replica in plan.replicas:
                by_node.setdefault(replica.node_id, []).append(replica.alloc_id)
        try:
            if started:
                client.index.put_revoke([p.put_id.hex() for p in plans])
        except MooncakeError:
            pass  # best effort: the agents reclaim by timeout anyway
        endpoints = {nodes[n].tcp_endpoint: ids for n, ids in by_node.items() if n in nodes}
        cancel = current_cancel()
        if cancel is not None and cancel.cancelled:
            # A closed PrefixCache cut this put; the client is open and its agents can still be
            # asked, but not on connections the cancelled Cancel would refuse, and not on this
            # thread, which owes its caller the "closed" error at once (an agent may be stalled).
            aside, endpoints = endpoints, {}
        else:
            failed_at = nodes[failed_node].tcp_endpoint if failed_node is not None and failed_node in nodes else None
            aside = {e: ids for e, ids in endpoints.items() if e == failed_at}
            endpoints = {e: ids for e, ids in endpoints.items() if e != failed_at}
        if aside:
            threading.Thread(target=self._free, args=(aside,), name="mc-abandon", daemon=True).start()
        self._free(endpoints)

    def _free(self, endpoints: dict[str, list[int]]) -> None:
        """Expire reservations now (best effort: the agents reclaim them by timeout anyway)."""
        with running_under(None):
            for endpoint, ids in endpoints.items():
                try:
                    self.client._tcp.peer(endpoint).free(ids)
                except MooncakeError:
                    pass
