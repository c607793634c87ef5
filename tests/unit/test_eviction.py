"""Victim choice and move destinations, on tables of objects and nodes."""

from __future__ import annotations

import dataclasses
from typing import Any

from mooncake_store.policy.eviction import (
    Move,
    MoveKind,
    bytes_to_free,
    choose_move,
    choose_victims,
    eviction_order,
    next_tier,
)
from mooncake_store.types import EvictionCandidate, NodeInfo, TierKind, TierUsage, TransportKind

MiB = 1 << 20
NOW = 10_000


def cand(key: str, *, age: int, size: int = MiB, lease: int = 0, pins: int = 0, pos: int = -1) -> EvictionCandidate:
    return EvictionCandidate(
        key=key,
        size_bytes=size,
        last_access_ms=NOW - age,
        lease_until_ms=lease,
        pins=pins,
        alloc_id=hash(key) & 0xFFFF,
        chain_pos=pos,
        dtype="<f2",
    )


def peer(node_id: str, *, used: int, capacity: int = 100 * MiB, zone: str = "z1", alive: bool = True) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        host="h",
        host_id="h",
        zone=zone,
        pid=1,
        tcp_endpoint="127.0.0.1:1",
        shm_name="s",
        transports=(TransportKind.TCP,),
        tiers=(TierUsage(tier=TierKind.HOST, capacity_bytes=capacity, used_bytes=used),),
        heartbeat_deadline_ms=NOW + 1000 if alive else NOW - 1,
    )


def move_of(peers: list[NodeInfo], **overrides: Any) -> Move:
    """choose_move for a 1 MiB host-tier victim on node "me" in zone z1 at the 0.9 watermark."""
    args: dict[str, Any] = {
        "tier": TierKind.HOST,
        "node_id": "me",
        "zone": "z1",
        "lower_tier": None,
        "lower_free_bytes": 0,
        "peers": peers,
        "now_ms": NOW,
        "high_watermark": 0.9,
    }
    args.update(overrides)
    return choose_move(MiB, **args)


def test_bytes_to_free() -> None:
    assert bytes_to_free(80, 100, high=0.9, low=0.75) == 0
    assert bytes_to_free(95, 100, high=0.9, low=0.75) == 20
    assert bytes_to_free(50, 100, high=0.9, low=0.75, wanted_bytes=60) == 10  # a waiting reservation
    assert bytes_to_free(50, 100, high=0.9, low=0.75, wanted_bytes=40) == 0
    # A drain that started above the high watermark goes on down to the low one.
    assert bytes_to_free(80, 100, high=0.9, low=0.75, draining=True) == 5
    assert bytes_to_free(75, 100, high=0.9, low=0.75, draining=True) == 0


def test_coldest_first_pinned_and_leased_never() -> None:
    cands = [
        cand("warm", age=10),
        cand("cold", age=1000),
        cand("pinned", age=5000, pins=1),
        cand("leased", age=4000, lease=NOW + 100),
        cand("colder", age=2000),
    ]
    assert [c.key for c in choose_victims(cands, need_bytes=2 * MiB, now_ms=NOW)] == ["colder", "cold"]
    assert [c.key for c in choose_victims(cands, need_bytes=100 * MiB, now_ms=NOW)] == ["colder", "cold", "warm"]
    assert choose_victims(cands, need_bytes=0, now_ms=NOW) == []


def test_chain_tails_first_among_equally_cold() -> None:
    # One batch lookup stamps a whole chain with the same access time.
    chain = [cand(f"c/{i}", age=500, pos=i) for i in range(5)]
    assert [c.key for c in choose_victims(chain, need_bytes=2 * MiB, now_ms=NOW)] == ["c/4", "c/3"]


def test_demote_when_the_lower_tier_has_room() -> None:
    move = move_of([peer("p", used=0)], lower_tier=TierKind.DISK, lower_free_bytes=2 * MiB)
    assert move.kind == MoveKind.DEMOTE and move.tier == TierKind.DISK


def test_spill_to_the_roomiest_peer_same_zone_first() -> None:
    peers = [
        peer("me", used=0),
        peer("far-empty", used=0, zone="z2"),
        peer("near-busy", used=60 * MiB),
        peer("near-roomy", used=10 * MiB),
        peer("dead", used=0, alive=False),
    ]
    move = move_of(peers)
    assert move.kind == MoveKind.SPILL and move.node_id == "near-roomy"


def test_never_push_a_peer_past_its_high_watermark_then_evict() -> None:
    peers = [peer("p", used=89 * MiB + MiB // 2)]
    move = move_of(peers)
    assert move.kind == MoveKind.EVICT
    no_spill = move_of([peer("p", used=0)], spill=False)
    assert no_spill.kind == MoveKind.EVICT


def test_next_tier() -> None:
    assert next_tier(TierKind.HOST, (TierKind.HOST, TierKind.DISK)) == TierKind.DISK
    assert next_tier(TierKind.HOST, (TierKind.HOST,)) is None
    assert next_tier(TierKind.GPU, (TierKind.GPU, TierKind.DISK)) == TierKind.DISK


def test_a_peer_is_judged_by_its_own_published_watermark() -> None:
    roomy_rule = peer("p", used=60 * MiB)
    roomy_rule.labels["high_watermark"] = "0.95"
    move = move_of([roomy_rule], high_watermark=0.5)
    assert move.kind == MoveKind.SPILL  # 61 MiB is under the peer's 95 %, though over our 50 %


def disk_peer(node_id: str, *, used: int, capacity: int, block: int) -> NodeInfo:
    usage = TierUsage(tier=TierKind.DISK, capacity_bytes=capacity, used_bytes=used, block_bytes=block)
    return dataclasses.replace(peer(node_id, used=0), tiers=(usage,))


def test_a_chunk_file_is_planned_in_the_peer_s_own_blocks() -> None:
    """A 100 B chunk file takes one 4 KiB block here and one 64 KiB block on a peer whose
    filesystem has those: the peer is judged by what the file takes there, not here."""
    kib = 1 << 10
    big_blocks = disk_peer("big", used=0, capacity=100 * kib, block=64 * kib)  # 90 KiB under its mark
    small_blocks = disk_peer("small", used=0, capacity=10 * kib, block=4 * kib)  # 9 KiB under its mark
    args: dict[str, Any] = {"tier": TierKind.DISK, "node_id": "me", "zone": "z1", "lower_tier": None}
    args |= {"lower_free_bytes": 0, "now_ms": NOW, "high_watermark": 0.9}
    # One file already planned onto "big" takes 64 KiB there: a second has no room, though by this
    # node's blocks (4 KiB each) it would have.
    assert choose_move(4 * kib, peers=[big_blocks], stored_bytes=100, **args).node_id == "big"
    planned = {"big": 64 * kib}
    assert choose_move(4 * kib, peers=[big_blocks], stored_bytes=100, planned_bytes=planned, **args).kind == (
        MoveKind.EVICT
    )
    too_small = disk_peer("tight", used=0, capacity=50 * kib, block=64 * kib)  # one block is past its mark
    assert choose_move(4 * kib, peers=[too_small], stored_bytes=100, **args).kind == MoveKind.EVICT
    assert choose_move(4 * kib, peers=[small_blocks], stored_bytes=100, **args).node_id == "small"
    # A peer that publishes no block size (an older agent) is judged by this node's footprint.
    silent = disk_peer("old", used=0, capacity=5 * kib, block=0)
    assert choose_move(4 * kib, peers=[silent], stored_bytes=100, **args).node_id == "old"
    assert choose_move(8 * kib, peers=[silent], stored_bytes=100, **args).kind == MoveKind.EVICT


def test_a_chunk_file_goes_only_to_a_peer_whose_memory_tiers_could_hold_it() -> None:
    """A peer's disk tier takes no chunk file of more plain bytes than its largest memory tier
    holds (it could never be read back into memory there): the roomiest disk refused the WRITE
    and was chosen again at every pass, while a peer that would take it was never asked."""

    def node(node_id: str, *, host: int, disk: int, gpu: int = 0) -> NodeInfo:
        tiers = (
            *disk_peer(node_id, used=0, capacity=disk, block=4096).tiers,
            *peer(node_id, used=0, capacity=host).tiers,
        )
        if gpu:
            tiers += (TierUsage(tier=TierKind.GPU, capacity_bytes=gpu, used_bytes=0),)
        return dataclasses.replace(peer(node_id, used=0), tiers=tiers)

    roomiest, smaller = node("roomiest", host=2 * MiB, disk=64 * MiB), node("smaller", host=2 * MiB, disk=32 * MiB)
    with_gpu = node("gpu", host=2 * MiB, disk=16 * MiB, gpu=8 * MiB)
    assert roomiest.largest_chunk_bytes == 2 * MiB and with_gpu.largest_chunk_bytes == 8 * MiB
    args: dict[str, Any] = {"tier": TierKind.DISK, "node_id": "me", "zone": "z1", "lower_tier": None}
    args |= {"lower_free_bytes": 0, "now_ms": NOW, "high_watermark": 0.9, "stored_bytes": MiB}
    assert choose_move(MiB, peers=[roomiest, smaller], plain_bytes=2 * MiB, **args).node_id == "roomiest"
    assert choose_move(MiB, peers=[roomiest, smaller], plain_bytes=2 * MiB + 1, **args).kind == MoveKind.EVICT
    assert choose_move(MiB, peers=[roomiest, smaller, with_gpu], plain_bytes=3 * MiB, **args).node_id == "gpu"
    # A host tier is not bound by it: the object goes there as plain bytes.
    host_args = {**args, "tier": TierKind.HOST, "stored_bytes": None}
    assert choose_move(MiB, peers=[peer("p", used=0)], plain_bytes=50 * MiB, **host_args).node_id == "p"


def test_the_node_table_carries_a_disk_tier_s_block_size() -> None:
    from mooncake_store.index.schema import decode_node, encode_node

    row = disk_peer("d", used=4096, capacity=1 << 20, block=65536)
    disk = decode_node(encode_node(row, "inc"), 0).tier(TierKind.DISK)
    assert disk is not None and disk.block_bytes == 65536
    assert disk.room_for(1, otherwise=7) == 65536 and disk.room_for(65537, otherwise=7) == 131072
    host = decode_node(encode_node(peer("h", used=0), "inc"), 0).tier(TierKind.HOST)
    assert host is not None and host.block_bytes == 0 and host.room_for(100, otherwise=7) == 7
    assert host.largest_free_bytes == 0  # not said: an older agent's row
    row = peer("h", used=MiB)
    said = dataclasses.replace(row, tiers=(dataclasses.replace(row.tiers[0], largest_free_bytes=3 * MiB),))
    host = decode_node(encode_node(said, "inc"), 0).tier(TierKind.HOST)
    assert host is not None and host.largest_free_bytes == 3 * MiB


def on_host(node: NodeInfo, host_id: str) -> NodeInfo:
    return dataclasses.replace(node, host_id=host_id)


def test_a_copy_goes_to_a_host_then_a_zone_that_its_other_copies_are_not_on() -> None:
    """A repair's source holds the object in z1: the copy it makes goes to z2, though a z1 peer has
    more room and z1 is the source's zone (two copies in one zone are lost with it)."""
    source = on_host(peer("me", used=0, zone="z1"), "h-me")
    roomy_same_zone = on_host(peer("z1-roomy", used=0, zone="z1"), "h-a")
    other_zone = on_host(peer("z2", used=50 * MiB, zone="z2"), "h-b")
    assert move_of([roomy_same_zone, other_zone]).node_id == "z1-roomy"  # no other copy: same zone first
    assert move_of([roomy_same_zone, other_zone], holders=[source]).node_id == "z2"
    # Another host first, even in a zone that holds a copy: one host's loss takes every copy on it.
    shared_host = on_host(peer("z2-shared", used=0, zone="z2"), "h-me")
    assert move_of([shared_host, roomy_same_zone], holders=[source]).node_id == "z1-roomy"
    # A spill of a copy whose twin is in z2 stays in this node's zone (z1), the twin's zone last.
    twin = on_host(peer("twin", used=0, zone="z2"), "h-t")
    assert move_of([other_zone, roomy_same_zone], holders=[twin]).node_id == "z1-roomy"
    # With nowhere else, a held host or zone still beats eviction.
    assert move_of([shared_host], holders=[source]).node_id == "z2-shared"


def test_eviction_order_puts_the_last_copies_of_objects_short_by_a_death_last() -> None:
    """Cold-first alone, a survivor evicted the last copies of objects a dead node left short of
    their replicas before its warmer single copies: a node's loss lost replicas=2 objects."""
    short = [dataclasses.replace(cand(f"short{i}", age=900 - i), survivor=True) for i in range(2)]
    single = [cand(f"one{i}", age=500 - i) for i in range(3)]
    homeless = sorted(short + single, key=lambda c: c.last_access_ms)  # as the walk meets them
    order = eviction_order(homeless, lambda c: c)
    assert [c.key for c in order] == ["one0", "one1", "one2", "short0", "short1"]


def test_a_peer_whose_free_room_is_in_pieces_smaller_than_the_victim_takes_none() -> None:
    """A peer publishes its largest free block: planned into a peer whose room was in smaller
    pieces, a victim was refused there, and the peer with it for the rest of the pass."""

    def pieces(node_id: str, *, largest: int, used: int = 40 * MiB) -> NodeInfo:
        row = peer(node_id, used=used)
        usage = dataclasses.replace(row.tiers[0], largest_free_bytes=largest)
        return dataclasses.replace(row, tiers=(usage,))

    roomy_in_pieces = pieces("pieces", largest=MiB // 2, used=10 * MiB)  # the most free bytes
    whole = pieces("whole", largest=8 * MiB)
    assert move_of([roomy_in_pieces, whole]).node_id == "whole"
    assert move_of([roomy_in_pieces]).kind == MoveKind.EVICT
    assert move_of([pieces("exact", largest=MiB)]).node_id == "exact"  # one block that holds it
    assert move_of([peer("unsaid", used=10 * MiB)]).node_id == "unsaid"  # an older agent: bytes alone
    # A repair asks a peer in pieces after every peer with a block: refused, it compacts its arena.
    assert move_of([roomy_in_pieces, whole], in_pieces_last=True).node_id == "whole"
    assert move_of([roomy_in_pieces], in_pieces_last=True).node_id == "pieces"
