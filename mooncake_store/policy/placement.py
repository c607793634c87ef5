"""Where a put goes (DESIGN.md §4): the writer's own host first, then the least loaded node of
the writer's zone, then the node with the most room anywhere. Further replicas of one object go
to another host, then another zone, where one has room (a departure from "same zone first" for
replicas > 1: two copies in one failure domain are lost together)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from mooncake_store.errors import ConnectError, NoCapacity
from mooncake_store.types import ALIGNMENT, NodeInfo, TierKind, footprint_bytes


def live_nodes(nodes: Iterable[NodeInfo], now_ms: int) -> list[NodeInfo]:
    return [n for n in nodes if n.heartbeat_deadline_ms >= now_ms]


def _free(node: NodeInfo, tier: TierKind) -> int:
    usage = node.tier(tier)
    return usage.free_bytes if usage else 0


def tier_capacity(node: NodeInfo, tier: TierKind) -> int:
    usage = node.tier(tier)
    return usage.capacity_bytes if usage else 0


def rank_nodes(
    nodes: Iterable[NodeInfo],
    *,
    size_bytes: int,
    now_ms: int,
    host_id: str,
    zone: str,
    tier: TierKind = TierKind.HOST,
    preferred_node: str | None = None,
    free_bytes: dict[str, int] | None = None,
    listed: Iterable[NodeInfo] | None = None,
) -> list[NodeInfo]:
    """Live nodes that may hold ``size_bytes`` in ``tier``, best first.

    ``free_bytes`` overrides the table's free space per node: a batch passes what will be left
    after its earlier objects, so one batch spreads over the zone instead of filling one node.
    ``listed``: the whole node table, where ``nodes`` is a part of it (those this client's
    transports reach, say): what a refusal says of a preferred node left out is judged on it.

    Free space in the node table is a few hundred ms old, so a node that looks full is kept at the
    end rather than dropped: its agent has the final word when asked to reserve.
    Raises NoCapacity when no live node's tier is large enough at all.
    """
    nodes = list(nodes)
    table = nodes if listed is None else list(listed)
    alive = [n for n in live_nodes(nodes, now_ms) if tier_capacity(n, tier) >= size_bytes]
    if preferred_node is not None:
        check_preferred(table, preferred_node, now_ms=now_ms)
        alive = [n for n in alive if n.node_id == preferred_node]
    if not alive:
        raise NoCapacity(
            no_room_message(
                nodes, size_bytes=size_bytes, now_ms=now_ms, tier=tier, preferred_node=preferred_node, listed=table
            ),
            permanent=True,
        )

    def score(n: NodeInfo) -> tuple[int, int, int, int, float, str]:
        free = free_bytes[n.node_id] if free_bytes and n.node_id in free_bytes else _free(n, tier)
        # A node that would not keep it (kept_bytes) goes after every node that would: its next
        # pressure pass moves it on, and with no peer to take it then, evicts it.
        keeps = 0 if kept_bytes(n, tier) >= size_bytes else 1
        # Its free bytes, and a block to hold them (where the node says: room in pieces holds no
        # larger object, and a reservation there is refused).
        usage = n.tier(tier)
        in_pieces = usage is not None and 0 < usage.largest_free_bytes < footprint_bytes(size_bytes)
        fits = 0 if free >= size_bytes and not in_pieces else 1
        same_host = 0 if n.host_id == host_id else 1
        same_zone = 0 if n.zone == zone else 1
        # In the writer's zone the least loaded node (its share of the tier in use), outside it
        # the one with the most room: a small node nearly empty went before a large one with
        # fifty times its free bytes, and filled up first.
        rank = 1.0 - free / max(1, tier_capacity(n, tier)) if same_zone == 0 else float(-free)
        return (keeps, fits, same_host, same_zone, rank, n.node_id)

    return sorted(alive, key=score)


def check_preferred(nodes: list[NodeInfo], preferred_node: str, *, now_ms: int) -> None:
    """A preferred node the table lists past its heartbeat deadline, while other nodes are within
    theirs, is a node that cannot be reached (dead, or stalled until its agent heartbeats again):
    ConnectError, as for a node that does not answer, not NoCapacity, which says the cluster has no
    room. With every node past its deadline the index was out of reach (each comes back at its next
    heartbeat): that is NoCapacity's "none within its heartbeat deadline", which a put waits out."""
    node = next((n for n in nodes if n.node_id == preferred_node), None)
    if node is not None and node.heartbeat_deadline_ms < now_ms and live_nodes(nodes, now_ms):
        late_s = (now_ms - node.heartbeat_deadline_ms) / 1000
        raise ConnectError(
            f"preferred node {preferred_node!r} is past its heartbeat deadline by {late_s:.1f} s: its agent is dead "
            "or stalled (a restarted one is back at its first heartbeat); put elsewhere, or again once it is back"
        )


def kept_bytes(node: NodeInfo, tier: TierKind) -> int:
    """The largest object put into ``tier`` of ``node`` that its agent keeps: one that leaves a
    memory tier past its high watermark by itself is moved on by the next pressure pass, and, with
    no tier anywhere to take it, evicted. A node with a disk tier keeps whatever its memory tiers
    can hold at all (a chunk file is compressed, and whether it then fits is known only there); an
    agent that publishes no watermark is taken at its capacity."""
    high = node.high_watermark(1.0)
    reach = (TierKind.GPU, TierKind.HOST) if tier == TierKind.GPU else (tier,)
    if tier_capacity(node, TierKind.DISK) > 0:
        return max(tier_capacity(node, t) for t in reach)
    # In whole allocation units: an object is counted in the arena's 64 B units, so one of exactly
    # high × capacity bytes took the tier past its watermark.
    return max(int(high * tier_capacity(node, t)) // ALIGNMENT * ALIGNMENT for t in reach)


def check_kept(
    nodes: Iterable[NodeInfo], *, size_bytes: int, now_ms: int, tier: TierKind = TierKind.HOST, replicas: int = 1
) -> None:
    """NoCapacity (permanent) for an object that fewer than ``replicas`` live nodes keep
    (``kept_bytes``): stored, a copy no node keeps is evicted by the first pressure pass, a put
    that succeeded and a get that then misses. Judged over every live node, since a node that does
    not keep an object spills it to one that does; but a node holding a copy is no target for
    another copy of the same object, so a second copy on a node that does not keep it was evicted
    within a second, leaving a replicas=2 put with one copy for good."""
    alive = live_nodes(nodes, now_ms)
    if len(alive) < replicas or size_bytes > max(tier_capacity(n, tier) for n in alive):
        return  # rank_nodes says "no live agent" or names the largest arena; choose_replica_nodes the count
    ranked = sorted(alive, key=lambda n: (-kept_bytes(n, tier), n.node_id))
    keepers = [n for n in ranked if kept_bytes(n, tier) >= size_bytes]
    if len(keepers) >= replicas:
        return
    advice = (
        "an object that takes a tier past its high watermark by itself is moved on, and with no tier to take "
        "it, evicted at once. Give an agent more memory, a higher --high-watermark, or a disk tier (--disk DIR "
        "--disk-mem SIZE)"
    )
    if replicas == 1:
        best = ranked[0]
        raise NoCapacity(
            f"need {size_bytes} B on {tier}, more than any live node keeps: the most is {kept_bytes(best, tier)} B, "
            f"on node {best.node_id} ({_kept_why(best)}); {advice}",
            permanent=True,
        )
    short = ", ".join(f"{n.node_id} {kept_bytes(n, tier)} B ({_kept_why(n)})" for n in ranked[len(keepers) :][:8])
    raise NoCapacity(
        f"replicas={replicas} needs {replicas} live nodes that keep {size_bytes} B on {tier}; only "
        f"{len(keepers)} do ({', '.join(n.node_id for n in keepers) or 'none'}), the others keep at most: {short}; "
        f"a copy on a node that does not keep it is evicted, as no node holding a copy takes another; {advice}",
        permanent=True,
    )


def _kept_why(node: NodeInfo) -> str:
    """Why ``node`` keeps what kept_bytes says, for a refusal."""
    if tier_capacity(node, TierKind.DISK) > 0:
        return "the capacity of its memory tier, with a disk tier behind it"
    return f"under its high watermark, {node.high_watermark(1.0):g} of its memory tier's capacity"


def check_batch_fits(
    nodes: Iterable[NodeInfo],
    sizes: list[int],
    *,
    replicas: int,
    now_ms: int,
    tier: TierKind = TierKind.HOST,
    preferred_node: str | None = None,
    held_bytes: Mapping[str, int] | None = None,
) -> None:
    """NoCapacity (permanent) for a batch whose objects the live nodes' ``tier`` cannot hold all
    at once (a batch's reservations are all held until it commits), however empty they were: a
    node holds at most as many of them as its smallest ones fill. Such a batch waited out
    timeout_s, then blamed pinned and leased objects that did not exist. Only this bound is
    checked: a batch that passes may still not fit, and then waits for room as any put does. The
    error's ``batch_limit`` is how many of the batch's first objects, in order, the nodes would
    keep under their high watermarks (a prompt's store writes those: PrefixCache.store).
    ``held_bytes``: bytes of ``tier`` per node that no room can be made of while the batch is
    written (the stored chain a prompt's store extends, which that store pins): "empty" leaves
    those."""
    held = held_bytes or {}
    if len(sizes) < 2:
        return  # one object: rank_nodes and check_kept say why, if it cannot be held
    alive = [n for n in live_nodes(nodes, now_ms) if tier_capacity(n, tier) > 0]
    if len(alive) < replicas:
        return  # choose_replica_nodes says that replicas=N needs N live nodes
    first = [n for n in alive if n.node_id == preferred_node] if preferred_node is not None else alive
    if not first:
        return  # rank_nodes says why the preferred node cannot take it
    if max(sizes) > max(tier_capacity(n, tier) for n in first):
        # An object no arena it may go to holds: rank_nodes names it and the largest arena. Told
        # "put it in smaller batches", the writer of a batch with one such object never succeeds.
        return

    def capacity(node: NodeInfo) -> int:
        return tier_capacity(node, tier) - held.get(node.node_id, 0)

    short = _batch_shortfall(alive, sizes, capacity, replicas=replicas, preferred_node=preferred_node)
    if short is None:
        return
    group, most, needed = short
    beside = f" but for the {sum(held.values())} B that stay there" if held else ""

    def kept(node: NodeInfo) -> int:
        return int(node.high_watermark(1.0) * tier_capacity(node, tier)) - held.get(node.node_id, 0)

    # The batch's first objects that the nodes would hold under their high watermarks, found by
    # halves (the longest such run where the objects are alike, as a prompt's chunks are): a run
    # that filled the arenas whole waited for every other object to go, and one pinned or leased
    # object anywhere left it waiting out the put's timeout.
    fits, too_many = 0, len(sizes)
    while too_many - fits > 1:
        middle = (fits + too_many) // 2
        if _batch_shortfall(alive, sizes[:middle], kept, replicas=replicas, preferred_node=preferred_node):
            too_many = middle
        else:
            fits = middle
    where = ", ".join(f"{n.node_id} {tier_capacity(n, tier)} B" for n in group) or "none"
    raise NoCapacity(
        f"a batch of {len(sizes)} object(s) ({sum(sizes)} B on {tier}, replicas={replicas}) cannot be held "
        f"at once: each object's room is held until the batch commits, and the {tier} tiers it may go to "
        f"({where}) hold at most {most} of the {needed} {'objects' if replicas == 1 else 'copies'} it needs "
        f"together, even empty{beside}; put it in smaller batches (its first {fits} would be kept)",
        permanent=True,
        batch_limit=fits,
    )


def _batch_shortfall(
    alive: list[NodeInfo],
    sizes: list[int],
    room_of: Callable[[NodeInfo], int],
    *,
    replicas: int,
    preferred_node: str | None,
) -> tuple[list[NodeInfo], int, int] | None:
    """The nodes that cannot hold their share of the batch ``sizes`` at once in ``room_of`` each,
    with the objects (or copies) they hold at most and need; None when every group can."""
    ordered = sorted(sizes)

    def most_held(node: NodeInfo) -> int:
        """Of the batch's objects, at most one copy each, as many as its smallest ones fill."""
        room, held = room_of(node), 0
        for size in ordered:
            room -= footprint_bytes(size)  # whole 64 B units, one at least
            if room < 0:
                break
            held += 1
        return held

    if preferred_node is not None:
        first = [n for n in alive if n.node_id == preferred_node]
        groups = [(first, len(sizes)), ([n for n in alive if n.node_id != preferred_node], len(sizes) * (replicas - 1))]
    else:
        groups = [(alive, len(sizes) * replicas)]
    for group, needed in groups:
        held = sum(most_held(n) for n in group)
        if needed and held < needed:
            return group, held, needed
    return None


def choose_replica_nodes(
    ranked: list[NodeInfo],
    replicas: int,
    *,
    has_room: Callable[[NodeInfo], bool] | None = None,
    keeps: Callable[[NodeInfo], bool] | None = None,
    left_out: Callable[[], str] | None = None,
) -> list[NodeInfo]:
    """``replicas`` distinct nodes of a ranking: the first as ranked, each further one on a host
    (then a zone) no chosen node is on, where one with room exists, else the next as ranked: two
    copies on one host are lost together. A node that ``keeps`` the object goes before any that
    does not, whatever its host: no node holding a copy takes another, so a copy on a node that
    does not keep it is evicted by its next pressure pass. NoCapacity if there are fewer nodes
    than replicas, saying why the others were left out (``left_out``)."""
    if replicas > len(ranked):
        why = left_out() if left_out is not None else ""
        raise NoCapacity(
            f"replicas={replicas} needs {replicas} live nodes with room; only {len(ranked)} qualify "
            f"({', '.join(n.node_id for n in ranked) or 'none'})" + (f"; left out: {why}" if why else ""),
            permanent=True,
        )
    room = has_room or (lambda _n: True)
    kept = keeps or (lambda _n: True)
    chosen = ranked[:1]
    rest = list(enumerate(ranked[1:]))
    while len(chosen) < replicas:
        hosts = {n.host_id for n in chosen}
        zones = {n.zone for n in chosen}
        pick = min(
            rest,
            key=lambda item: (
                not kept(item[1]),
                not room(item[1]),
                item[1].host_id in hosts,
                item[1].zone in zones,
                item[0],
            ),
        )
        rest.remove(pick)
        chosen.append(pick[1])
    return chosen


def left_out_nodes(
    listed: Iterable[NodeInfo], ranked: Iterable[NodeInfo], *, size_bytes: int, now_ms: int, tier: TierKind
) -> str:
    """Why each node of ``listed`` is not in ``ranked``, for choose_replica_nodes' refusal."""
    chosen = {n.node_id for n in ranked}
    parts = []
    for node in listed:
        if node.node_id in chosen:
            continue
        if node.heartbeat_deadline_ms < now_ms:
            parts.append(f"{node.node_id} (past its heartbeat deadline)")
        elif tier_capacity(node, tier) < size_bytes:
            parts.append(f"{node.node_id} ({tier_capacity(node, tier)} B of {tier} in all, under {size_bytes} B)")
        else:
            parts.append(f"{node.node_id} (no transport of this client reaches it, or a write there failed)")
    return ", ".join(parts[:8]) + (f" and {len(parts) - 8} more" if len(parts) > 8 else "")


def waited_for_room(timeout_s: float) -> str:
    """Said of a put that waited for room in vain: why room may not come (a node full of prompts
    that engines held as prefix hits was said only to have little free)."""
    return (
        f"no room came within timeout_s ({timeout_s:g} s): objects pinned by a held prefix hit or read "
        "under a live lease neither move nor are evicted"
    )


def no_room_message(
    nodes: Iterable[NodeInfo],
    *,
    size_bytes: int,
    now_ms: int,
    tier: TierKind = TierKind.HOST,
    preferred_node: str | None = None,
    listed: Iterable[NodeInfo] | None = None,
) -> str:
    """Why no node of ``nodes`` takes the object (``listed``: the whole table, as in rank_nodes)."""
    nodes = list(nodes)
    alive = live_nodes(nodes, now_ms)
    if not alive and nodes:
        # Registered, and none within its deadline: stalled, or the index was out of reach for
        # longer than a TTL (each comes back at its next heartbeat); "start one" would mislead.
        return (
            f"need {size_bytes} B on {tier}; {len(nodes)} agent(s) registered, none within its heartbeat "
            "deadline (stalled, or the index was out of reach; `mooncake stat` shows their heartbeat ages)"
        )
    if not alive:
        return f"need {size_bytes} B on {tier}; no live agent is registered (start one: `mooncake up`)"
    if preferred_node is not None and preferred_node not in {n.node_id for n in alive}:
        node = next((n for n in (nodes if listed is None else listed) if n.node_id == preferred_node), None)
        if node is None:
            why = "is not a registered agent"
        elif node.heartbeat_deadline_ms < now_ms:
            why = "is past its heartbeat deadline"
        else:  # listed, live, and left out of ``nodes``
            why = (
                "cannot take this put from this client (no transport it allows reaches the node, the node "
                f"has no {tier} tier it can write, or a write there failed in this put)"
            )
        return f"need {size_bytes} B on {tier}; preferred node {preferred_node!r} {why}"
    if preferred_node is not None:
        node = next(n for n in alive if n.node_id == preferred_node)
        return (
            f"need {size_bytes} B on {tier}; preferred node {preferred_node!r} has {tier_capacity(node, tier)} B "
            f"of {tier} in all"
        )
    parts = ", ".join(f"node {n.node_id} has {_free(n, tier)}/{tier_capacity(n, tier)} B free" for n in alive[:8])
    largest = max(tier_capacity(n, tier) for n in alive)
    return f"need {size_bytes} B on {tier}; the largest {tier} arena is {largest} B; {parts}"
