"""The pure decisions, on tables of nodes and allocations."""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_store.errors import ConnectError, NoCapacity
from mooncake_store.policy.placement import check_kept, choose_replica_nodes, kept_bytes, no_room_message, rank_nodes
from mooncake_store.policy.reclaim import expired_reservations, plan_sync
from mooncake_store.policy.transport_choice import choose_transport, order_replicas
from mooncake_store.types import NodeInfo, Replica, TierKind, TierUsage, TransportKind

MiB = 1 << 20
NOW = 1_000_000


def node(
    node_id: str, *, free: int, capacity: int = 100 * MiB, host: str = "h1", zone: str = "z1", alive: bool = True
) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        host=host,
        host_id=host,
        zone=zone,
        pid=1,
        tcp_endpoint="127.0.0.1:1",
        shm_name=f"seg-{node_id}",
        transports=(TransportKind.SHM, TransportKind.TCP),
        tiers=(TierUsage(tier=TierKind.HOST, capacity_bytes=capacity, used_bytes=capacity - free),),
        heartbeat_deadline_ms=NOW + 5000 if alive else NOW - 1,
    )


def ranked_ids(nodes: list[NodeInfo], size: int, **kw: object) -> list[str]:
    return [n.node_id for n in rank_nodes(nodes, size_bytes=size, now_ms=NOW, host_id="h1", zone="z1", **kw)]  # type: ignore[arg-type]


def test_own_host_first_then_zone_then_most_free() -> None:
    nodes = [
        node("far-roomy", free=90 * MiB, host="h3", zone="z2"),
        node("zone-busy", free=20 * MiB, host="h2"),
        node("zone-roomy", free=80 * MiB, host="h4"),
        node("mine", free=10 * MiB),
    ]
    assert ranked_ids(nodes, MiB) == ["mine", "zone-roomy", "zone-busy", "far-roomy"]


def test_nodes_without_room_go_last_and_dead_nodes_never() -> None:
    nodes = [
        node("mine", free=MiB // 2),
        node("other", free=50 * MiB, host="h2"),
        node("dead", free=99 * MiB, alive=False),
    ]
    assert ranked_ids(nodes, MiB) == ["other", "mine"]


def test_too_big_for_every_arena_is_permanent_and_names_sizes() -> None:
    nodes = [node("a", free=10 * MiB, capacity=10 * MiB)]
    with pytest.raises(NoCapacity) as info:
        ranked_ids(nodes, 11 * MiB)
    assert info.value.permanent
    assert str(11 * MiB) in str(info.value) and str(10 * MiB) in str(info.value)


def with_tiers(base: NodeInfo, *, high: str | None, disk: int = 0, gpu: int = 0) -> NodeInfo:
    tiers = list(base.tiers)
    if disk:
        tiers.append(TierUsage(tier=TierKind.DISK, capacity_bytes=disk, used_bytes=0))
    if gpu:
        tiers.append(TierUsage(tier=TierKind.GPU, capacity_bytes=gpu, used_bytes=0))
    return dataclasses.replace(base, tiers=tuple(tiers), labels={} if high is None else {"high_watermark": high})


def test_an_object_is_kept_up_to_the_high_watermark_or_the_capacity_with_a_disk_behind() -> None:
    plain = with_tiers(node("a", free=10 * MiB, capacity=10 * MiB), high="0.5")
    assert kept_bytes(plain, TierKind.HOST) == 5 * MiB
    assert kept_bytes(with_tiers(plain, high="0.5", disk=MiB), TierKind.HOST) == 10 * MiB
    assert kept_bytes(with_tiers(plain, high=None), TierKind.HOST) == 10 * MiB  # an agent that publishes none
    assert kept_bytes(with_tiers(plain, high="junk"), TierKind.HOST) == 10 * MiB
    # A GPU object is demoted to host memory; a host object never goes to a GPU tier.
    both = with_tiers(plain, high="0.5", gpu=4 * MiB)
    assert kept_bytes(both, TierKind.GPU) == 5 * MiB and kept_bytes(both, TierKind.HOST) == 5 * MiB


def test_an_object_no_live_node_keeps_is_refused_with_the_most_any_keeps() -> None:
    small = with_tiers(node("small", free=10 * MiB, capacity=10 * MiB), high="0.5")
    dead_large = with_tiers(node("dead", free=90 * MiB, alive=False), high="0.9")
    check_kept([small], size_bytes=5 * MiB, now_ms=NOW)
    with pytest.raises(NoCapacity) as info:
        check_kept([small, dead_large], size_bytes=5 * MiB + 1, now_ms=NOW)
    assert info.value.permanent
    message = str(info.value)
    assert str(5 * MiB + 1) in message and str(5 * MiB) in message and "small" in message and "0.5" in message
    # Any live node that keeps it will do: the one it lands on spills it there.
    large = with_tiers(node("large", free=90 * MiB, host="h2"), high="0.9")
    check_kept([small, large], size_bytes=9 * MiB, now_ms=NOW)
    check_kept([], size_bytes=1 << 30, now_ms=NOW)  # no live node: rank_nodes says so, with its advice


def test_a_node_that_keeps_the_object_ranks_before_an_emptier_one_that_does_not() -> None:
    """The writer's own empty 16 MiB node took a 15 MiB object it keeps no more than 14.4 MiB of,
    and its pass, with no peer under its watermark to spill to, evicted it."""
    small = with_tiers(node("small", free=16 * MiB, capacity=16 * MiB), high="0.9")
    large = with_tiers(node("large", free=19 * MiB, capacity=64 * MiB, host="h2"), high="0.9")
    assert ranked_ids([small, large], 15 * MiB) == ["large", "small"]
    assert ranked_ids([small, large], 14 * MiB) == ["small", "large"]  # kept by both: own host first
    assert ranked_ids([small, large], 15 * MiB, preferred_node="small") == ["small"]  # the caller's choice
    assert kept_bytes(with_tiers(small, high="0.9"), TierKind.HOST) == int(0.9 * 16 * MiB) // 64 * 64


def test_no_live_nodes_says_so() -> None:
    with pytest.raises(NoCapacity, match="none within its heartbeat deadline"):
        ranked_ids([node("dead", free=MiB, alive=False)], 1)
    with pytest.raises(NoCapacity, match="no live agent"):
        ranked_ids([], 1)


def test_preferred_node_pins_the_choice() -> None:
    nodes = [node("mine", free=90 * MiB), node("b", free=1 * MiB, host="h2")]
    assert ranked_ids(nodes, 1000, preferred_node="b") == ["b"]
    with pytest.raises(NoCapacity, match="preferred node 'zz' is not a registered agent"):
        ranked_ids(nodes, 1000, preferred_node="zz")


def test_a_preferred_node_past_its_deadline_cannot_be_reached_and_one_too_small_says_its_size() -> None:
    """Both were NoCapacity "preferred node ... is not a live agent": a dead node is one that
    cannot be reached (ConnectError, as for one that does not answer), and a live one whose tier is
    smaller than the object was called not live."""
    nodes = [
        node("mine", free=90 * MiB),
        node("dead", free=90 * MiB, alive=False),
        node("small", free=MiB, capacity=MiB),
    ]
    with pytest.raises(ConnectError, match=r"preferred node 'dead' is past its heartbeat deadline by 0\.0 s"):
        ranked_ids(nodes, 1000, preferred_node="dead")
    with pytest.raises(NoCapacity, match=f"preferred node 'small' has {MiB} B of host in all"):
        ranked_ids(nodes, 2 * MiB, preferred_node="small")


def test_a_preferred_node_past_its_deadline_with_every_other_too_is_an_outage_waited_for() -> None:
    """Every listed node past its deadline is the index's own outage (each is back at its next
    heartbeat): NoCapacity "none within its heartbeat deadline", which a put waits out, not the
    ConnectError of one dead node among live ones."""
    nodes = [node("a", free=90 * MiB, alive=False), node("b", free=90 * MiB, alive=False)]
    with pytest.raises(NoCapacity, match="none within its heartbeat deadline"):
        ranked_ids(nodes, 1000, preferred_node="a")


def test_a_preferred_node_this_client_cannot_use_is_not_called_unregistered() -> None:
    """Ranked over the nodes this client's transports reach (``listed`` is the whole table): a
    registered, live node left out was called "not a registered agent"; and a dead one left out
    was not found dead."""
    reached = [node("mine", free=90 * MiB)]
    table = [*reached, node("remote", free=90 * MiB, host="h9"), node("gone", free=90 * MiB, alive=False)]
    with pytest.raises(NoCapacity, match="preferred node 'remote' cannot take this put from this client"):
        ranked_ids(reached, 1000, preferred_node="remote", listed=table)
    with pytest.raises(ConnectError, match="preferred node 'gone' is past its heartbeat deadline"):
        ranked_ids(reached, 1000, preferred_node="gone", listed=table)
    with pytest.raises(NoCapacity, match="preferred node 'zz' is not a registered agent"):
        ranked_ids(reached, 1000, preferred_node="zz", listed=table)


def test_replicas_need_distinct_nodes() -> None:
    nodes = [node("a", free=MiB), node("b", free=MiB, host="h2")]
    assert [n.node_id for n in choose_replica_nodes(nodes, 2)] == ["a", "b"]
    with pytest.raises(NoCapacity, match="replicas=3"):
        choose_replica_nodes(nodes, 3)


def test_transport_choice() -> None:
    same = node("same", free=MiB)
    other = node("other", free=MiB, host="h2")
    both = (TransportKind.SHM, TransportKind.TCP)
    assert choose_transport(same, allowed=both, host_id="h1", shm_reachable=True) == TransportKind.SHM
    assert choose_transport(same, allowed=both, host_id="h1", shm_reachable=False) == TransportKind.TCP
    assert choose_transport(same, allowed=(TransportKind.TCP,), host_id="h1", shm_reachable=True) == TransportKind.TCP
    assert choose_transport(other, allowed=both, host_id="h1", shm_reachable=True) == TransportKind.TCP
    assert choose_transport(other, allowed=(TransportKind.SHM,), host_id="h1", shm_reachable=True) is None


def test_replicas_ordered_cheapest_first() -> None:
    nodes = {"same": node("same", free=MiB), "other": node("other", free=MiB, host="h2")}
    reps = [
        Replica(node_id=n, tier=TierKind.HOST, offset=0, size_bytes=1, alloc_id=i)
        for i, n in enumerate(["other", "gone", "same"])
    ]
    ordered = order_replicas(
        reps, nodes, allowed=(TransportKind.SHM, TransportKind.TCP), host_id="h1", shm_names_reachable={"seg-same"}
    )
    assert [(r.node_id, k) for r, _, k in ordered] == [("same", TransportKind.SHM), ("other", TransportKind.TCP)]


def gpu_node_on(host: str, node_id: str, *, ipc: bool = True) -> NodeInfo:
    base = node(node_id, free=MiB, host=host)
    tiers = (*base.tiers, TierUsage(tier=TierKind.GPU, capacity_bytes=MiB, used_bytes=0))
    return dataclasses.replace(base, tiers=tiers, labels={"gpu_ipc": "00" * 64} if ipc else {})


def test_gpu_replicas_take_cuda_ipc_only_on_the_same_host_with_cuda_and_shm_allowed() -> None:
    """CUDA IPC is the GPU tier's same-host path: SHM for a GPU replica, when this process can use
    CUDA and the node publishes a handle; otherwise its agent serves it over TCP."""
    both = (TransportKind.SHM, TransportKind.TCP)
    same, other, no_handle = gpu_node_on("h1", "g"), gpu_node_on("h2", "g2"), gpu_node_on("h1", "g3", ipc=False)
    gpu = {"tier": TierKind.GPU, "host_id": "h1", "shm_reachable": True}
    assert choose_transport(same, allowed=both, cuda_ipc=True, **gpu) == TransportKind.SHM  # type: ignore[arg-type]
    assert choose_transport(same, allowed=both, cuda_ipc=False, **gpu) == TransportKind.TCP  # type: ignore[arg-type]
    assert choose_transport(other, allowed=both, cuda_ipc=True, **gpu) == TransportKind.TCP  # type: ignore[arg-type]
    assert choose_transport(no_handle, allowed=both, cuda_ipc=True, **gpu) == TransportKind.TCP  # type: ignore[arg-type]
    tcp_only = (TransportKind.TCP,)
    assert choose_transport(same, allowed=tcp_only, cuda_ipc=True, **gpu) == TransportKind.TCP  # type: ignore[arg-type]
    # A disk replica is decoded by its agent, whatever the host.
    disk = {"tier": TierKind.DISK, "host_id": "h1", "shm_reachable": True, "cuda_ipc": True}
    assert choose_transport(same, allowed=both, **disk) == TransportKind.TCP  # type: ignore[arg-type]


def test_replicas_ordered_by_path_then_by_tier_for_the_destination() -> None:
    """A same-host copy beats any transfer through an agent; within one path, host memory is read
    first into host buffers, and GPU memory first into device buffers over the same-host path."""
    nodes = {"g": gpu_node_on("h1", "g"), "far": gpu_node_on("h2", "far")}
    reps = [
        Replica(node_id="far", tier=TierKind.DISK, offset=0, size_bytes=1, alloc_id=1),
        Replica(node_id="far", tier=TierKind.HOST, offset=0, size_bytes=1, alloc_id=2),
        Replica(node_id="far", tier=TierKind.GPU, offset=0, size_bytes=1, alloc_id=3),
        Replica(node_id="g", tier=TierKind.GPU, offset=0, size_bytes=1, alloc_id=4),
        Replica(node_id="g", tier=TierKind.HOST, offset=0, size_bytes=1, alloc_id=5),
    ]
    kw = {"allowed": (TransportKind.SHM, TransportKind.TCP), "host_id": "h1", "shm_names_reachable": {"seg-g"}}
    to_host = order_replicas(reps, nodes, cuda_ipc=True, **kw)  # type: ignore[arg-type]
    assert [r.alloc_id for r, _, _ in to_host] == [5, 4, 2, 3, 1]
    to_device = order_replicas(reps, nodes, cuda_ipc=True, to_device=True, **kw)  # type: ignore[arg-type]
    # Through an agent both land in host memory first: host before gpu there too.
    assert [r.alloc_id for r, _, _ in to_device] == [4, 5, 2, 3, 1]
    no_cuda = order_replicas(reps, nodes, cuda_ipc=False, **kw)  # type: ignore[arg-type]
    # Without CUDA here the same-host GPU replica goes through its agent, after the remote host one.
    assert [(r.alloc_id, k) for r, _, k in no_cuda][:2] == [(5, TransportKind.SHM), (2, TransportKind.TCP)]
    assert {r.alloc_id: k for r, _, k in no_cuda}[4] == TransportKind.TCP


def test_expired_reservations() -> None:
    assert expired_reservations({1: 5.0, 2: 10.0, 3: 4.0}, now=5.0) == [1, 3]


def test_plan_sync_rules() -> None:
    plan = plan_sync(
        expired=[2, 3, 4],
        expired_status=["R", "G", "G"],
        acked=[1, 4, 99],
        graves=[7, 8],
        holds={1, 2, 3, 4, 5, 7}.__contains__,
    )
    assert plan.commit == (1, 4)  # acked reservations become objects; 99 is unknown here
    # 2 revoked by the sync, 3 gone and not acked (its writer revoked or died), 7 a known grave;
    # 4 was gone because it committed (acked in the same sync); 8 was freed before.
    assert plan.free == (2, 3, 7)


def test_projected_free_space_spreads_a_batch() -> None:
    nodes = [node("a", free=50 * MiB, host="h2"), node("b", free=40 * MiB, host="h3")]
    assert ranked_ids(nodes, MiB) == ["a", "b"]
    assert ranked_ids(nodes, MiB, free_bytes={"a": 30 * MiB}) == ["b", "a"]
    assert ranked_ids(nodes, MiB, free_bytes={"a": 0}) == ["b", "a"]


def test_an_ack_commits_even_a_reservation_newer_than_the_snapshot() -> None:
    # The whole put (reserve, write, commit) landed between the sync's snapshot and its round trip:
    # the ack is drained now and never comes again, so it must commit.
    plan = plan_sync(expired=[], expired_status=[], acked=[42], graves=[], holds={42}.__contains__)
    assert plan.commit == (42,) and plan.free == ()


def test_a_node_row_older_than_the_incarnation_holding_a_replica_is_stale() -> None:
    """Alloc ids carry their incarnation's tag; a client's copy of the row from before a restart
    of the node (another tag) must be read again before the replica is reached."""
    from mooncake_store.index.schema import decode_node, encode_node
    from mooncake_store.types import ALLOC_TAG_SHIFT, alloc_tag_of, stale_for

    row = dataclasses.replace(node("a", free=MiB), alloc_tag=0x1234)
    assert decode_node(encode_node(row, "inc"), 0).alloc_tag == 0x1234
    mine = Replica(node_id="a", tier=TierKind.HOST, offset=0, size_bytes=1, alloc_id=(0x1234 << ALLOC_TAG_SHIFT) + 7)
    later = dataclasses.replace(mine, alloc_id=(0x4321 << ALLOC_TAG_SHIFT) + 1)
    assert alloc_tag_of(mine.alloc_id) == 0x1234 and mine.alloc_id < 2**63
    assert not stale_for(mine, row) and stale_for(later, row)
    assert not stale_for(later, dataclasses.replace(row, alloc_tag=0))  # an untagged row: no judgement
    assert not stale_for(later, None)


def test_further_replicas_go_to_other_hosts_then_other_zones() -> None:
    """The first replica as ranked (the writer's host first); each further one on a host, then a
    zone, no chosen replica is on, where such a node has room: two copies on one host die together."""
    nodes = [
        node("mine-1", free=MiB),
        node("mine-2", free=MiB),
        node("near", free=MiB, host="h2"),
        node("far", free=MiB, host="h3", zone="z2"),
    ]
    assert [n.node_id for n in choose_replica_nodes(nodes, 2)] == ["mine-1", "far"]
    assert [n.node_id for n in choose_replica_nodes(nodes, 3)] == ["mine-1", "far", "near"]
    assert [n.node_id for n in choose_replica_nodes(nodes, 4)] == ["mine-1", "far", "near", "mine-2"]
    full = {"far", "near"}
    picked = choose_replica_nodes(nodes, 2, has_room=lambda n: n.node_id not in full)
    assert [n.node_id for n in picked] == ["mine-1", "mine-2"]  # no other host has room: as ranked


def test_plan_sync_frees_each_allocation_once() -> None:
    """A grave listed twice, or also expired and revoked in the same sync, is freed once."""
    plan = plan_sync(expired=[2], expired_status=["R"], acked=[], graves=[7, 2, 7, 9], holds={2, 7}.__contains__)
    assert plan.free == (2, 7)


def test_no_room_with_every_registered_node_past_its_deadline_does_not_say_start_one() -> None:
    """After an index outage every node is past its deadline until its next heartbeat: "no live
    agent is registered (start one: `mooncake up`)" sent the user to start a running cluster."""
    stale = [node("a", free=MiB, alive=False), node("b", free=MiB, alive=False)]
    message = no_room_message(stale, size_bytes=10, now_ms=NOW)
    assert "2 agent(s) registered, none within its heartbeat deadline" in message and "start one" not in message
    assert "start one" in no_room_message([], size_bytes=10, now_ms=NOW)


def test_a_node_whose_free_room_is_in_pieces_smaller_than_the_object_ranks_with_those_without_room() -> None:
    """Its reservation would be refused: ranked by free bytes alone, it went first and cost the
    put a round trip (a probe) at every try until its row said otherwise."""
    in_pieces = node("pieces", free=90 * MiB)
    usage = dataclasses.replace(in_pieces.tiers[0], largest_free_bytes=MiB // 2)
    in_pieces = dataclasses.replace(in_pieces, tiers=(usage,))
    nodes = [in_pieces, node("whole", free=20 * MiB, host="h2")]
    assert ranked_ids(nodes, MiB) == ["whole", "pieces"]
    assert ranked_ids(nodes, MiB // 2) == ["pieces", "whole"]  # what its largest block holds
