"""`print(client.stat())` printed a dataclass dump of every field of every tier of every node, on
one line thousands of characters long, with sizes in bytes (session-29 note). Each stats value's
repr is now a short summary: sizes in binary units and the counters that are not 0."""

from __future__ import annotations

from mooncake_store import ClusterStats, NodeStats
from mooncake_store.client.stats import TierStats

MiB = 1 << 20


def _node(node_id: str, *, alive: bool, tiers: tuple[TierStats, ...]) -> NodeStats:
    return NodeStats(
        node_id=node_id, host="h", zone="z1", pid=1, alive=alive, heartbeat_age_s=12.5, heartbeat_deadline_in_s=-7.5,
        tcp_endpoint="127.0.0.1:7601", shm_name="", transports=("shm", "tcp"), objects=3, tiers=tiers,
    )  # fmt: skip


def test_stats_reprs_are_short_with_sizes_in_units_and_nonzero_counters_only() -> None:
    host = TierStats(tier="host", capacity_bytes=256 * MiB, used_bytes=3 * MiB, objects=3, hits=5, spills_out=2)
    disk = TierStats(tier="disk", capacity_bytes=MiB << 10, used_bytes=0, objects=0, compression_ratio=1.5)
    assert repr(host) == "TierStats(host: 3.0 MiB of 256.0 MiB, 3 objects, hits 5, spills_out 2)"
    assert repr(disk) == "TierStats(disk: 0 B of 1.0 GiB, 0 objects, compression 1.50x)"
    live, down = _node("a1", alive=True, tiers=(host, disk)), _node("a2", alive=False, tiers=(host,))
    assert repr(down).startswith("NodeStats('a2' down 12.5 s, 127.0.0.1:7601, zone 'z1', 3 objects, tiers=[TierStats(")
    stats = ClusterStats(
        nodes=(live, down), objects=6, capacity_bytes=512 * MiB, used_bytes=6 * MiB, hits=10, misses=1, evictions=4
    )
    text = repr(stats)
    assert text.startswith(
        "ClusterStats(1 of 2 nodes live, 6 objects, 6.0 MiB of 512.0 MiB used, hits 10, misses 1, evictions 4; nodes=["
    ), text
    assert "\n" not in text and "corrupt" not in text and "capacity_bytes" not in text
    empty = ClusterStats(nodes=(), objects=1, capacity_bytes=0, used_bytes=0, hits=0, misses=0)
    assert repr(empty) == "ClusterStats(0 of 0 nodes live, 1 object, 0 B of 0 B used; nodes=[])"  # no zero counters
    assert len(text) < 600, len(text)
    assert stats.as_dict()["nodes"][0]["tiers"][0]["capacity_bytes"] == 256 * MiB  # every field is still there
