"""A damaged chunk file met by a spill (a disk-tier probe, 2026-12-07): the peer refused the file at
its WRITE, the sender's check found the damage and dropped the replica, and the pass placed the
same victim on that peer again in the same pass; refused whole a second time, the peer took none
of the pass's other victims, and a healthy object was evicted while the peer's disk was 98% free.
The damaged replica was also counted corrupt twice."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
from helpers import wait_until

from mooncake_store import LocalCluster, MooncakeError, connect
from mooncake_store.client.stats import TierStats

MiB = 1 << 20


def _value(i: int) -> np.ndarray:
    return (np.random.default_rng(i).standard_normal(MiB // 2) * 0.05).astype(np.float16)


def _tier(cluster: LocalCluster, node_id: str, tier: str) -> TierStats:
    with connect(cluster.redis_url, namespace=cluster.namespace) as client:
        (node,) = [n for n in client.stat().nodes if n.node_id == node_id]
        return next(t for t in node.tiers if t.tier == tier)


def test_a_damaged_file_refused_by_a_peer_costs_no_healthy_object(redis_url: str, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with LocalCluster(0, redis_url=redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}") as cluster:
        small = ["--host-bytes", str(8 * MiB), "--disk", str(disk), "--disk-mem", "12MiB", "--no-prefault"]
        cluster.add_agent(node_id="a", extra_args=small)
        roomy = ["--host-bytes", str(64 * MiB), "--disk", str(disk), "--disk-mem", "256MiB", "--no-prefault"]
        cluster.add_agent(node_id="b", extra_args=[*roomy, "--no-spill"])
        with connect(cluster.redis_url, namespace=cluster.namespace, timeout_s=30, lease_ms=300) as client:
            first = {f"k{i:02d}": _value(i) for i in range(14)}
            for key, value in first.items():
                client.put(key, value, preferred_node="a")

            def on_disk() -> list[tuple[str, int]]:
                metas = {key: client.object_meta(key) for key in first}
                return [
                    (key, meta.replicas[0].alloc_id)
                    for key, meta in metas.items()
                    if meta is not None and str(meta.replicas[0].tier) == "disk"
                ]

            assert wait_until(lambda: len(on_disk()) >= 3, 20.0), on_disk()
            damaged, alloc_id = on_disk()[0]  # the coldest on a's disk: the first its disk spills
            name = f"{alloc_id:016x}"
            path = disk / "a" / name[-2:] / f"{name}.mcz"
            raw = bytearray(path.read_bytes())
            raw[200] ^= 1  # one bit of its body
            path.write_bytes(bytes(raw))

            more = {f"m{i:02d}": _value(100 + i) for i in range(14)}  # a's disk overflows: spills to b's
            for key, value in more.items():
                client.put(key, value, preferred_node="a")

            def spilled_past_the_damage() -> bool:
                # The damaged file is the coldest on a's disk: the first its passes send to b. Then
                # the drain ends under the disk's high watermark (how many files that takes, and
                # how many of a's objects go to b's host tier instead, varies with the timing).
                disk = _tier(cluster, "a", "disk")
                return disk.corrupt >= 1 and disk.spills_out >= 1 and disk.used_bytes <= 0.9 * disk.capacity_bytes

            assert wait_until(spilled_past_the_damage, 60.0), _tier(cluster, "a", "disk")
            for key, value in {**first, **more}.items():
                if key == damaged:
                    continue
                assert np.array_equal(client.get(key), value), key
            try:
                got = client.get(damaged)
            except MooncakeError:
                pass  # its one copy was the damaged file: gone, never read as other bytes
            else:
                assert np.array_equal(got, first[damaged])
            a_disk = _tier(cluster, "a", "disk")
            assert a_disk.evictions == 0, a_disk
            assert a_disk.corrupt == 1, a_disk
            assert client.stat().corrupt == 1
