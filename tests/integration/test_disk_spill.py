"""The disk tier under pressure with a peer: cold chunk files move to the disk tier of the peer
with the most room (DESIGN.md §3.4: copy, compare-and-swap, free), stay readable byte-exact, are
promoted by the peer on read, and leave no file behind when removed; and the wire rules of a disk
reservation, checked frame by frame against a real agent."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until
from index_audit import settled_audit

from mooncake_store import Client, LocalCluster, MooncakeError
from mooncake_store.errors import NoCapacity, ProtocolError, StaleLocation
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.transport.tcp import PeerConnections

MiB = 1 << 20
TIER_DISK = 2
SPILL = 1


def kv_value(key: str) -> np.ndarray:
    """1 MiB of float16 that compresses like a KV cache (so chunk files are smaller than objects)."""
    seed = int.from_bytes(key.encode()[-6:].rjust(8, b"\0"), "little")
    return (np.random.default_rng(seed).standard_normal(MiB // 2) * 0.05).astype(np.float16)


def tiers_of(client: Client, key: str) -> list[tuple[str, str]]:
    meta = client.object_meta(key)
    assert meta is not None, key
    return [(r.node_id, str(r.tier)) for r in meta.replicas]


def disk_counters(client: Client) -> dict[str, object]:
    return {n.node_id: next(t for t in n.tiers if str(t.tier) == "disk") for n in client.stat().nodes}


def test_cold_chunk_files_spill_to_the_peers_disk_tier(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    cluster = make_cluster(0)
    disk_args = ["--disk", str(tmp_path)]
    cluster.add_agent(node_id="agent-0", extra_args=["--host-bytes", str(8 * MiB), *disk_args, "--disk-mem", "12MiB"])
    # The peer's host tier has room, so it never demotes: what lands on its disk came from agent-0's.
    cluster.add_agent(node_id="agent-1", extra_args=["--host-bytes", str(96 * MiB), *disk_args, "--disk-mem", "256MiB"])
    writer = make_client(cluster, lease_ms=300, timeout_s=30)
    reader = make_client(cluster, lease_ms=300)
    keys: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def read_back() -> None:
        rng = np.random.default_rng(3)
        while not stop.is_set():
            if not keys:
                stop.wait(0.01)
                continue
            key = keys[int(rng.integers(len(keys)))]
            try:
                if not np.array_equal(reader.get(key), kv_value(key)):
                    failures.append(f"{key}: wrong bytes")
            except MooncakeError as exc:  # KeyNotFound included: nothing is ever removed here
                failures.append(f"{key}: {exc!r}")
            stop.wait(0.02)

    thread = threading.Thread(target=read_back)
    thread.start()
    try:
        for i in range(48):  # six times agent-0's host tier, about three times its disk tier
            key = f"kv/{i:03d}"
            writer.put(key, kv_value(key), preferred_node="agent-0")
            keys.append(key)
        # Past its high watermark (0.9 x 12 MiB) agent-0 moves files away down to the low one; host
        # demotions may then fill it again up to the high one, which is where it must stay.
        assert wait_until(lambda: disk_counters(writer)["agent-0"].used_bytes <= 0.9 * 12 * MiB, 20), disk_counters(
            writer
        )
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not failures, failures[:5]
    on_peer_disk = [k for k in keys if tiers_of(writer, k) == [("agent-1", "disk")]]
    assert on_peer_disk, {k: tiers_of(writer, k) for k in keys}
    assert wait_until(  # counters reach the node table with the next heartbeat
        lambda: (
            disk_counters(writer)["agent-0"].spills_out >= len(on_peer_disk)  # type: ignore[attr-defined]
            and disk_counters(writer)["agent-1"].spills_in >= len(on_peer_disk)  # type: ignore[attr-defined]
        ),
        5,
    ), disk_counters(writer)
    agent_1_host = next(n for n in writer.stat().nodes if n.node_id == "agent-1").tiers[0]
    assert str(agent_1_host.tier) == "host" and agent_1_host.demotions == 0
    # agent-1 learnt each spilled file's key from the swap's ack: a read promotes it to its host tier.
    first = on_peer_disk[0]
    assert np.array_equal(writer.get(first), kv_value(first))
    assert wait_until(lambda: tiers_of(writer, first) == [("agent-1", "host")], 5)
    assert wait_until(lambda: disk_counters(writer)["agent-1"].promotions >= 1, 5)  # type: ignore[attr-defined]
    # Byte-exact from every tier of both agents; the files on agent-1's disk are exactly its replicas.
    for key in keys:
        got = writer.get(key)
        assert got.dtype == np.float16 and np.array_equal(got, kv_value(key)), key
    assert wait_until(
        lambda: (
            len(list((tmp_path / "agent-1").rglob("*.mcz")))
            == sum(1 for k in keys if ("agent-1", "disk") in tiers_of(writer, k))
        ),
        5,
    )
    assert not settled_audit(writer.index)
    # Removing everything deletes every chunk file on both agents.
    writer.remove_many(keys)
    assert wait_until(lambda: not list(tmp_path.rglob("*.mcz")), 10), list(tmp_path.rglob("*.mcz"))


def test_disk_reservations_follow_the_wire_rules(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    cluster = make_cluster(0)
    agent = cluster.add_agent(node_id="agent-0", extra_args=["--disk", str(tmp_path / "agent"), "--disk-mem", "4MiB"])
    source = DiskTier(tmp_path / "source", 8 * MiB)
    source.write(1, memoryview(kv_value("blob").view(np.uint8)), itemsize=2)
    blob = source.read_blob(1)
    peer = PeerConnections(agent.endpoint, timeout_s=5, max_idle=2)
    try:
        with pytest.raises(NoCapacity, match="on disk; node agent-0 takes none there"):  # puts never go to disk
            peer.reserve([(len(blob), b"w" * 16)], node_id="agent-0", tier=TIER_DISK)
        with pytest.raises(NoCapacity, match="need 5242880 B in 1 object"):  # more than the disk holds
            peer.reserve([(5 * MiB, b"w" * 16)], node_id="agent-0", tier=TIER_DISK, flags=SPILL)
        with pytest.raises(ProtocolError, match="status"):  # no tier 3
            peer.reserve([(len(blob), b"w" * 16)], node_id="agent-0", tier=3, flags=SPILL)
        (res,) = peer.reserve([(len(blob), b"s" * 16)], node_id="agent-0", tier=TIER_DISK, flags=SPILL)
        with pytest.raises(StaleLocation):  # a chunk file never comes in pieces
            peer.write(res.alloc_id, res.offset, memoryview(blob)[:-1])
        damaged = bytearray(blob)
        damaged[len(damaged) // 2] ^= 0xFF
        with pytest.raises(StaleLocation):  # fails its checksum: refused, nothing stored
            peer.write(res.alloc_id, res.offset, memoryview(damaged))
        assert not list((tmp_path / "agent").rglob("*.mcz"))
        peer.write(res.alloc_id, res.offset, memoryview(blob))
        assert len(list((tmp_path / "agent").rglob("*.mcz"))) == 1
        with pytest.raises(StaleLocation):  # a stored file is never rewritten
            peer.write(res.alloc_id, res.offset, memoryview(blob))
        # The sender gives up (no swap reached the index): the agent's next sync removes the file.
        assert peer.free([res.alloc_id]) == 1
        assert wait_until(lambda: not list((tmp_path / "agent").rglob("*.mcz")), 5)
        # The connection is still good, and so is the agent.
        client = make_client(cluster)
        client.put("after", np.arange(10, dtype=np.int64))
        assert client.get("after").tolist() == list(range(10))
    finally:
        peer.close()


def test_the_disk_directory_of_a_killed_agent_is_removed_by_the_next_agent_on_the_path(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    """A SIGKILLed agent leaves its chunk files under <disk>/<node id>; with the default node id
    (host and pid) its successor gets a directory of its own, and the files stayed for good (up to
    the whole disk tier per crash). The next agent started on the path removes them; a stopped
    agent removes its own directory."""
    cluster = make_cluster(0)
    disk = ["--disk", str(tmp_path), "--disk-mem", "16MiB"]
    # Watermarks low enough that a few puts demote to disk.
    marks = ["--high-watermark", "0.5", "--low-watermark", "0.25"]
    doomed = cluster.add_agent(node_id="doomed", extra_args=["--host-bytes", str(4 * MiB), *disk, *marks])
    client = make_client(cluster)
    for i in range(6):
        client.put(f"gone/{i}", kv_value(f"gone/{i}"), preferred_node="doomed")
    assert wait_until(lambda: list((tmp_path / "doomed").rglob("*.mcz")), 10), "nothing was demoted to disk"
    doomed.kill()
    assert list((tmp_path / "doomed").rglob("*.mcz")), "the killed agent's files went by themselves"
    survivor = cluster.add_agent(node_id="next", extra_args=[*disk])
    assert not (tmp_path / "doomed").exists(), sorted(p.name for p in tmp_path.rglob("*"))
    assert (tmp_path / "next").is_dir()
    survivor.stop()
    assert not (tmp_path / "next").exists()
