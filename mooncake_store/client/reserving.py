"""Where a put's replicas go: the ranking of nodes for each object, and the RESERVE frames that
ask the chosen agents for room (one per agent and tier, or per group of a replicated batch's other
nodes where one is asked to make room), with the fallbacks when one refuses.

A writer with other nodes to try asks as a probe (transport/frames.py PROBE_FLAG): refused, the
node makes no room. Only once no node takes an object is the node that refused it first asked
again, now to make room, and the put waits for that room (PutPath.run). Asked plainly everywhere,
every node a writer tried made room for it, each an eviction when nothing could move: three
600 KiB puts on two 1 MiB agents lost two objects instead of one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mooncake_store.client.put_plans import PlannedPut
from mooncake_store.errors import AgentBusy, ConnectError, MooncakeError, NoCapacity, TransferError
from mooncake_store.policy.placement import (
    check_batch_fits,
    check_kept,
    choose_replica_nodes,
    kept_bytes,
    left_out_nodes,
    live_nodes,
    rank_nodes,
)
from mooncake_store.policy.transport_choice import gpu_ipc_node
from mooncake_store.transport import frames
from mooncake_store.types import NodeInfo, Replica, ReplicaState, TierKind, footprint_bytes

if TYPE_CHECKING:
    from mooncake_store.client.client import Client

#: RESERVE tier numbers on the wire (transport/frames.py).
WIRE_TIER = {TierKind.HOST: frames.TIER_HOST, TierKind.GPU: frames.TIER_GPU}

#: How a put undoes reservations it will not use (PutPath.abandon).
Abandon = Callable[..., None]


def room_ask_groups(replicas: int, plans: list[PlannedPut], node_id: str) -> list[tuple[int, list[PlannedPut]]]:
    """The RESERVE asks (flags, their plans) of a writer that asks ``node_id`` to make room for
    ``plans`` (no PROBE_FLAG): a put with replicas on several nodes names the nodes its other
    replicas are on or assigned to (frames.replicated_flags), and the node makes that room by
    spills to its other peers, else by demotion or eviction, not by spills into the peers where
    those replicas need room. One ask per group of plans whose other replicas carry the same marks,
    in the plans' order: asked once with the marks of every plan, a replicas=2 batch whose second
    replicas spread over every other node spared them all, and the node evicted cold objects while
    those peers had room for them. The room made for each group goes to the peers it does not use.
    The caller asks the groups one after another and stops at the first refused: the agent spares
    the union of the marks of every ask that waits for its next pass (RoomRequests.spared, agent/drains.py), so
    two refused at once would spare every peer again."""
    if replicas <= 1:
        return [(0, plans)]
    asks: dict[int, list[PlannedPut]] = {}
    for plan in plans:
        others = {r.node_id for r in plan.replicas} | plan.assigned
        asks.setdefault(frames.replicated_flags(others - {node_id}), []).append(plan)
    return list(asks.items())


class Reserver:
    """The reservations of one put attempt (PutPath._put_once): ``reserve`` returns the node
    table it placed by, every plan's replicas reserved, or raises having undone them (``abandon``)."""

    def __init__(self, client: Client, abandon: Abandon) -> None:
        self.client = client
        self._abandon = abandon

    def _candidates(
        self,
        plan: PlannedPut,
        nodes: dict[str, NodeInfo],
        *,
        now: int,
        preferred_node: str | None,
        replicas: int,
        free_bytes: dict[str, int] | None = None,
    ) -> list[NodeInfo]:
        """Nodes for the plan's replicas, best first. ``preferred_node`` takes the first replica
        (and with one replica it is the only candidate: the put waits for its room); further
        replicas go where the ranking puts them."""
        # Over every live node: one that does not keep the object spills it to one that does.
        check_kept(nodes.values(), size_bytes=plan.size_bytes, now_ms=now, tier=plan.tier, replicas=replicas)
        pool = [n for n in nodes.values() if n.node_id not in plan.avoid]
        if plan.tier == TierKind.GPU:
            pool = [n for n in pool if gpu_ipc_node(n, self.client.host_id)]
        else:
            # Only where this client's transports can carry the bytes: a put must not store what the
            # same client could not read back (transports=("shm",) forces the same-host path).
            reachable = [n for n in pool if self.client._can_write_to(n)]
            # Those it reaches all past their deadlines while live ones it does not reach are
            # there (a shm-only client whose agent died): said so, rather than "none within its
            # heartbeat deadline" of the dead one alone, as if the index had been out of reach. A
            # NoCapacity, as that was: judged on the cached node table, it is judged once more on
            # a fresh one (puts.py), where the agent may be back.
            stalled = reachable if reachable and not live_nodes(reachable, now) else []
            unreached = [n for n in live_nodes(pool, now) if n not in reachable] if stalled else pool
            if pool and unreached and (not reachable or stalled):
                allowed = tuple(str(t) for t in self.client.transports)
                why = [
                    f"shm reaches only agents on this host ({', '.join(sorted(n.node_id for n in unreached))} are "
                    "not, or their arenas cannot be mapped here)"
                    if "shm" in allowed
                    else "shm is not allowed",
                    "tcp is not allowed",
                ]
                if stalled:
                    why[0] += (
                        f", and those it reaches ({', '.join(sorted(n.node_id for n in stalled))}) are past their "
                        "heartbeat deadline"
                    )
                if "rdma" in allowed:
                    why.append("rdma is not built yet (README, Not built yet)")
                reaches = f"reaches {'a live' if stalled else 'an'} agent for a put of {plan.key!r}"
                message = f"no allowed transport {allowed} {reaches}: " + "; ".join(why)
                if stalled:
                    raise NoCapacity(message, permanent=True)
                raise TransferError(message)
            pool = reachable

        def ranked(preferred: str | None) -> list[NodeInfo]:
            return rank_nodes(
                pool,
                size_bytes=max(1, plan.size_bytes),
                now_ms=now,
                host_id=self.client.host_id,
                zone=self.client.zone,
                tier=plan.tier,
                preferred_node=preferred,
                free_bytes=free_bytes,
                listed=nodes.values(),
            )

        first = ranked(preferred_node)
        if preferred_node is None or replicas == 1:
            return first
        return first + [n for n in ranked(None) if n.node_id != preferred_node]

    def reserve(
        self, plans: list[PlannedPut], replicas: int, preferred_node: str | None, *, room_asks: int = 1
    ) -> dict[str, NodeInfo]:
        """Reserve space for every plan on ``replicas`` nodes; one RESERVE frame per node and tier
        (on ``preferred_node``, asked to make room, one per group of the plans' other nodes:
        room_ask_groups).
        ``room_asks``: how many of the nodes that refused an object for want of room are asked to
        make it (_ask_for_room), one more for each second the put has waited for room."""
        client = self.client
        nodes, now = client._node_table(), client._server_now_ms()
        if preferred_node in nodes and nodes[preferred_node].heartbeat_deadline_ms < now:  # dead on a cached table?
            nodes, now = client._node_table(refresh=True), client._server_now_ms()  # judged afresh (check_preferred)
        tiers = {p.tier for p in plans}
        for tier in tiers:
            sizes = [p.size_bytes for p in plans if p.tier == tier]
            try:
                check_batch_fits(
                    nodes.values(), sizes, replicas=replicas, now_ms=now, tier=tier, preferred_node=preferred_node
                )
            except NoCapacity as exc:
                if len(tiers) > 1:
                    exc.batch_limit = None  # counted in one tier's objects: no count of the batch's first ones
                raise
        # Plan against free space as it will be after this batch: a batch spreads out.
        projected = self._free_room(nodes, now)
        groups: dict[tuple[str, TierKind], list[PlannedPut]] = {}
        for plan in plans:
            free = projected[plan.tier]
            ranked = self._candidates(
                plan, nodes, now=now, preferred_node=preferred_node, replicas=replicas, free_bytes=free
            )
            size = max(1, plan.size_bytes)

            def has_room(n: NodeInfo, free: dict[str, int] = free, size: int = size) -> bool:
                return free.get(n.node_id, 0) >= size

            def keeps(n: NodeInfo, size: int = size, tier: TierKind = plan.tier) -> bool:
                return kept_bytes(n, tier) >= size

            def left_out(ranked: list[NodeInfo] = ranked, size: int = size, tier: TierKind = plan.tier) -> str:
                return left_out_nodes(nodes.values(), ranked, size_bytes=size, now_ms=now, tier=tier)

            for node in choose_replica_nodes(ranked, replicas, has_room=has_room, keeps=keeps, left_out=left_out):
                free[node.node_id] = free.get(node.node_id, 0) - size
                groups.setdefault((node.node_id, plan.tier), []).append(plan)
                plan.assigned.add(node.node_id)
        try:
            for (node_id, tier), group in groups.items():
                node = nodes[node_id]
                # A probe, unless the caller pinned the put here: refused, the node makes no room
                # for a writer with other nodes to try (_reserve_elsewhere asks it to, once none of
                # them has room). Pinned here, one ask per group of the plans' other nodes
                # (room_ask_groups), up to the first the node refuses.
                asks = (
                    room_ask_groups(replicas, group, node_id)
                    if node_id == preferred_node
                    else [(frames.PROBE_FLAG, group)]
                )
                for count, (flags, asked) in enumerate(asks):
                    try:
                        got = client._tcp.peer(node.tcp_endpoint).reserve(
                            [(p.size_bytes, p.put_id) for p in asked],
                            node_id=node_id,
                            tier=WIRE_TIER[tier],
                            flags=flags,
                        )
                    except (NoCapacity, ConnectError, TransferError) as exc:
                        if not isinstance(exc, NoCapacity):
                            client._tcp.drop_peer_after(node.tcp_endpoint, exc)
                        # Ranked on a table read after the refusal: the wait for a hung node can
                        # outlast every row's deadline in the table read before it. The groups not
                        # asked yet go with the refused one.
                        rest = [plan for _, later in asks[count:] for plan in later]
                        elsewhere = self._reserve_elsewhere(
                            rest, nodes, node_id, replicas, preferred_node, refusal=exc, room_asks=room_asks
                        )
                        nodes = {**nodes, **elsewhere}
                        break
                    for plan, res in zip(asked, got, strict=True):
                        plan.replicas.append(self._replica(node_id, tier, res.offset, res.alloc_id, plan.size_bytes))
        except BaseException:
            self._abandon(plans, nodes, started=False)
            raise
        return nodes

    def _reserve_elsewhere(
        self,
        group: list[PlannedPut],
        nodes: dict[str, NodeInfo],
        failed_node: str,
        replicas: int,
        preferred_node: str | None,
        *,
        refusal: MooncakeError,
        room_asks: int = 1,
    ) -> dict[str, NodeInfo]:
        """One object at a time on the remaining candidates, after a node turned a batch down
        (``refusal``: what it said), each asked as a probe. What none of them takes is asked of
        the nodes that refused it for want of room, now to make room (_ask_for_room), and the put
        then waits for that room. The preferred node's replica has no other candidate: NoCapacity,
        and the put waits for that node to make room. A node that could not be reached (dead,
        hung, or at its connection limit: AgentBusy) is no node without room: when that is all
        that stood in the way the put fails at once with what happened, rather than wait out
        timeout_s for room and then blame a lack of it. Returns the node table it ranked by: read
        afresh after a node that did not answer (its timeout may have outlasted every deadline of
        the older one, and every other node then looked dead: "no live agent is registered"). A
        node that table lists at another endpoint restarted under its id since: it is asked again
        there."""
        client = self.client
        failed_endpoint = nodes[failed_node].tcp_endpoint
        unreachable = not isinstance(refusal, NoCapacity)
        if unreachable:
            nodes = client._node_table(refresh=True)
        moved = unreachable and failed_node in nodes and nodes[failed_node].tcp_endpoint != failed_endpoint
        now = client._server_now_ms()
        if failed_node == preferred_node and not moved:
            if unreachable:
                raise type(refusal)(f"preferred_node {preferred_node!r}: {refusal}") from refusal
            raise NoCapacity(
                f"preferred_node {preferred_node!r} has no room for {len(group)} object(s) "
                f"(first key {group[0].key!r}): {refusal}"
            )
        homeless: list[tuple[PlannedPut, list[tuple[str, MooncakeError]]]] = []
        free = self._free_room(nodes, now)
        for plan in group:
            # Every node this plan is assigned to, reserved yet or not: two replicas on one node are one.
            taken = {r.node_id for r in plan.replicas} | plan.assigned
            if moved:
                taken.discard(failed_node)  # assigned to it, but not reserved there: ask it where it is now
            else:
                taken.add(failed_node)
            errors: list[tuple[str, MooncakeError]] = [(failed_node, refusal)]
            candidates = self._candidates(
                plan, nodes, now=now, preferred_node=preferred_node, replicas=replicas, free_bytes=free[plan.tier]
            )
            for node in candidates:
                if node.node_id in taken:
                    continue
                try:
                    (res,) = client._tcp.peer(node.tcp_endpoint).reserve(
                        [(plan.size_bytes, plan.put_id)],
                        node_id=node.node_id,
                        tier=WIRE_TIER[plan.tier],
                        flags=frames.PROBE_FLAG,
                    )
                except (NoCapacity, ConnectError, TransferError) as exc:
                    errors.append((node.node_id, exc))
                    continue
                plan.replicas.append(self._replica(node.node_id, plan.tier, res.offset, res.alloc_id, plan.size_bytes))
                plan.assigned.add(node.node_id)
                break
            else:
                said = [exc for _, exc in errors]
                if not any(isinstance(exc, NoCapacity) for exc in said):
                    # Not one refused for room: waiting for room would wait for nothing.
                    why = "; ".join(str(exc) for exc in said)
                    kind = next((type(exc) for exc in said if isinstance(exc, AgentBusy)), type(said[0]))
                    raise kind(f"no node could take key {plan.key!r} (replicas={replicas}): {why}")
                homeless.append((plan, errors))
        if homeless:
            self._ask_for_room(homeless, nodes, failed_node if not moved else None, room_asks, replicas)
        return nodes

    def _ask_for_room(
        self,
        homeless: list[tuple[PlannedPut, list[tuple[str, MooncakeError]]]],
        nodes: dict[str, NodeInfo],
        first_choice: str | None,
        room_asks: int,
        replicas: int,
    ) -> None:
        """Ask the first ``room_asks`` nodes that refused these plans for want of room (the first
        choice first) for them again, not as a probe: refused, a node makes room for all of them
        together, and the put's next try finds it; a node with room by now takes them. The put
        asks one more node for each second it has waited (PutPath.run): a first choice whose
        objects are all pinned made no room, and the put waited out timeout_s while other nodes
        could have made it. NoCapacity for what none of them takes."""
        refused = (node_id for _, errors in homeless for node_id, exc in errors if isinstance(exc, NoCapacity))
        refusers = [node_id for node_id in dict.fromkeys(refused) if node_id in nodes]
        asked = 0
        for node_id in refusers:
            if asked >= max(1, room_asks) or not homeless:
                break
            wanting = [
                plan
                for plan, _ in homeless
                if node_id == first_choice or node_id not in ({r.node_id for r in plan.replicas} | plan.assigned)
            ]
            if not wanting:
                continue  # no ask spent on a node none of them may go to
            asked += 1
            for tier in {plan.tier for plan in wanting}:
                # No more than the node keeps: it makes room for all it is asked for together or
                # for none, and a batch stacked on one node (none had room when it was planned:
                # 3 x 6 MiB for a 16 MiB arena) was refused at every ask until timeout_s, though
                # each node could make room for its share. The rest go to the next node asked.
                of_tier = _kept_share([plan for plan in wanting if plan.tier == tier], nodes[node_id], tier)
                if not of_tier:
                    continue
                # One ask per group of the plans' other nodes (room_ask_groups), up to the first the
                # node refuses: refused, it makes room for that group, and the groups after it wait
                # for the put's next try (asked now too, their marks joined the refused one's in
                # the node's next pass). They may still go to the next node asked.
                for flags, asked_plans in room_ask_groups(replicas, of_tier, node_id):
                    try:
                        got = self.client._tcp.peer(nodes[node_id].tcp_endpoint).reserve(
                            [(plan.size_bytes, plan.put_id) for plan in asked_plans],
                            node_id=node_id,
                            tier=WIRE_TIER[tier],
                            flags=flags,
                        )
                    except (NoCapacity, ConnectError, TransferError):
                        break  # asked to make room: the put's next try finds it, here or where else it was asked
                    for plan, res in zip(asked_plans, got, strict=True):
                        plan.replicas.append(self._replica(node_id, tier, res.offset, res.alloc_id, plan.size_bytes))
                        plan.assigned.add(node_id)
                    homeless = [(plan, errors) for plan, errors in homeless if plan not in asked_plans]
        if homeless:
            plan, errors = homeless[0]
            why = "; ".join(str(exc) for _, exc in errors)
            raise NoCapacity(
                f"no node could take {plan.size_bytes} B for key {plan.key!r} (replicas={replicas}): {why}"
                + (f" (and {len(homeless) - 1} more object(s) of the batch)" if len(homeless) > 1 else "")
            )

    def _free_room(self, nodes: dict[str, NodeInfo], now: int) -> dict[TierKind, dict[str, int]]:
        """Each node's free room per tier as its row says, less what this client reserved there
        since the row was published (client/placed.py): a writer putting in a loop spreads its
        puts as one batch spreads its objects."""
        room: dict[TierKind, dict[str, int]] = {}
        for tier in (TierKind.HOST, TierKind.GPU):
            unseen = self.client._placed.unseen(nodes, tier, now_ms=now)
            room[tier] = {
                n.node_id: (usage.free_bytes if (usage := n.tier(tier)) else 0) - unseen.get(n.node_id, 0)
                for n in nodes.values()
            }
        return room

    def _replica(self, node_id: str, tier: TierKind, offset: int, alloc_id: int, size: int) -> Replica:
        """A reservation granted: noted for the ranking of this client's next puts (placed.py)."""
        self.client._placed.note(node_id, tier, size, at_ms=self.client._server_now_ms())
        return Replica(
            node_id=node_id, tier=tier, offset=offset, size_bytes=size, alloc_id=alloc_id, state=ReplicaState.PENDING
        )


def _kept_share(plans: list[PlannedPut], node: NodeInfo, tier: TierKind) -> list[PlannedPut]:
    """The first of ``plans`` that ``node`` keeps together in ``tier`` (kept_bytes, in whole
    allocation units)."""
    room, taken = kept_bytes(node, tier), 0
    for count, plan in enumerate(plans):
        taken += footprint_bytes(plan.size_bytes)
        if taken > room:
            return plans[:count]
    return plans
