"""The chaos kit's check of agents against the index, tier by tier (tests/tier_audit.py), and the
chaos load on agents with disk tiers: objects demoted to disk and promoted back, spilled between
peers, one and two replicas, while agents are SIGKILLed (by their own pids) and restarted under
their node ids. Only 127.0.0.1; seeds fixed; every loop bounded in count and time.

What must hold: an object stored with two replicas that had a copy off the killed node is still
there once the node is reaped and the copies are made again (the load is sized so that nothing is
evicted); every read is one whole version that was put; no load thread hangs; and at the end each
agent's disk directory holds one chunk file per disk replica the index lists on it (no leaked file,
no replica naming a missing file), as its host tier holds what the index names there."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

from chaos_kit import (
    WATERMARKS,
    Ledger,
    MiB,
    agents_match_index,
    check_bytes,
    key_name,
    reader_loop,
    remover_loop,
    replacer_loop,
    typed,
    value_of,
    writer_loop,
)
from helpers import wait_until
from tier_audit import audit_tiers, chunk_files

from mooncake_store import Client, KeyNotFound, LocalCluster
from mooncake_store.tiers.host import SHM_DIR
from mooncake_store.types import TierKind

NODES = ["agent-0", "agent-1", "agent-2"]


def disk_args(node_id: str, root: Path, *, disk_mib: int = 128) -> list[str]:
    """8 MiB host arenas over disk tiers: the load demotes (agent-0 spills over TCP), and two agents
    hold all of it, with both copies of every object stored with two, under their high watermarks
    (nothing is evicted)."""
    extra = ["--host-bytes", str(8 * MiB), "--disk", str(root), "--disk-mem", f"{disk_mib}MiB", *WATERMARKS]
    return [*extra, "--no-spill-shm"] if node_id == "agent-0" else extra


def disk_replicas(client: Client) -> dict[str, list[str]]:
    """Keys with a replica on a disk tier, by node."""
    out: dict[str, list[str]] = {}
    for entry in client.index.list_keys("*"):
        for r in entry.replicas:
            if r.tier == TierKind.DISK:
                out.setdefault(r.node_id, []).append(entry.key)
    return out


def test_the_check_covers_each_disk_tier_and_its_files(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    """With objects on the host and disk tiers, the check passes (it once took every replica on a
    node for a host one, and failed any agent with a disk tier); a chunk file no replica names, a
    disk replica whose file is gone and a temp file left are each reported, and the agents without
    a GPU tier are said to be unchecked there."""
    cluster = make_cluster(0, reserve_timeout_s=2.0)
    for node_id in NODES[:2]:
        cluster.add_agent(node_id=node_id, extra_args=disk_args(node_id, tmp_path / "disk"))
    client = make_client(cluster, lease_ms=200, timeout_s=20)
    for i in range(24):
        client.put(f"k/{i}", typed(i, value_of(i, 0, 1 * MiB)), replicas=1 + i % 2, preferred_node="agent-0")
    assert wait_until(lambda: sum(map(len, disk_replicas(client).values())) >= 4, 20), disk_replicas(client)
    nodes = NODES[:2]
    assert wait_until(lambda: agents_match_index(client, nodes, cluster)[0], 15, 0.5), agents_match_index(
        client, nodes, cluster
    )[1]
    audit = audit_tiers(client, nodes, disk_dirs={a.node_id: a.disk_dir for a in cluster.agents})
    assert "gpu tier: none of 2 agents has one, not checked" in audit.notes, audit.notes
    # Without the directories, a disk tier's files cannot be checked: said, never passed over.
    assert not audit_tiers(client, nodes).ok
    node_id = next(n for n, keys in disk_replicas(client).items() if keys)
    root = Path(cluster.agent(node_id).disk_dir)
    files, _ = chunk_files(root)
    assert files, f"no chunk file under {root}"
    # A file no replica names: leaked space.
    stray = root / "ab" / f"{0x7FFF_0000_0000_00AB:016x}.mcz"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"x" * 100)
    ok, said = agents_match_index(client, nodes, cluster)
    assert not ok and "chunk files no replica names" in said, said
    stray.unlink()
    # A disk replica whose file went (moved aside, then put back).
    alloc = next(iter(files))
    path = root / f"{alloc:016x}"[-2:] / f"{alloc:016x}.mcz"
    aside = tmp_path / "aside.mcz"
    path.rename(aside)
    try:
        ok, said = agents_match_index(client, nodes, cluster)
        assert not ok and "disk replicas with no file" in said, said
    finally:
        aside.rename(path)
    temp = path.with_suffix(".tmp")
    temp.write_bytes(b"")
    ok, said = agents_match_index(client, nodes, cluster)
    temp.unlink()
    assert not ok and "temp files left" in said, said
    assert agents_match_index(client, nodes, cluster)[0], agents_match_index(client, nodes, cluster)[1]


def test_kills_and_restarts_of_disk_tier_agents_lose_no_replicated_object(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    cluster = make_cluster(0, reserve_timeout_s=2.0, heartbeat_ttl_s=2.0)
    disk = tmp_path / "disk"
    for node_id in NODES:
        cluster.add_agent(node_id=node_id, zone="z", extra_args=disk_args(node_id, disk))
    ledger = Ledger()
    stop = threading.Event()
    writers_c = [make_client(cluster, lease_ms=400, timeout_s=20) for _ in range(2)]
    readers = [
        make_client(cluster, lease_ms=400, timeout_s=4),
        make_client(cluster, lease_ms=400, timeout_s=4, transports=("tcp",)),
    ]
    mutator = make_client(cluster, lease_ms=400, timeout_s=20)
    probe = make_client(cluster, lease_ms=400, timeout_s=20)

    def allowed_miss(key_id: int, why: str) -> bool:
        return True  # judged by what the index held around each kill, and at the end

    writers = [
        threading.Thread(target=writer_loop, args=(c, ledger, 10_000 * i, 36, 301 + i, stop, 0.5, 0.05, None))
        for i, c in enumerate(writers_c)
    ]
    # Readers pause 50 ms between reads: at 10 ms every key of the load held a read lease all
    # the time, an object read within its lease is hot and never demoted, and puts waited for room.
    threads = [
        *writers,
        *(
            threading.Thread(target=reader_loop, args=(c, ledger, 311 + i, stop, allowed_miss, 0.05))
            for i, c in enumerate(readers)
        ),
        threading.Thread(target=remover_loop, args=(mutator, ledger, 321, stop, 0.6)),
        threading.Thread(target=replacer_loop, args=(mutator, ledger, 331, stop)),
    ]

    def holders() -> dict[str, set[str]]:
        return {x.key: {r.node_id for r in x.replicas} for x in probe.index.list_keys("chaos/*")}

    rng = random.Random(341)
    lost: list[str] = []
    disk_used = 0
    for t in threads:
        t.start()
    try:
        # Two kills: the first restarted once reaped, the second at once (its start waits out the
        # dead record's deadline).
        for cycle in range(2):
            time.sleep(rng.uniform(2.0, 4.0))
            disk_used += sum(map(len, disk_replicas(probe).values()))
            victim_id = rng.choice(NODES)
            victim = cluster.agent(victim_id)
            before = holders()
            with ledger.lock:
                doubles = {key_name(k) for k, n in ledger.replicas.items() if n == 2 and k not in ledger.removing}
            victim.kill()
            (SHM_DIR / victim.shm_name).unlink(missing_ok=True)  # as a host failure would
            cluster.agents.remove(victim)
            if cycle == 1:
                cluster.add_agent(node_id=victim_id, zone="z", extra_args=disk_args(victim_id, disk))
            else:
                assert wait_until(lambda v=victim_id: v not in probe.index.nodes(), 15, 0.1)
            assert wait_until(lambda: probe.stat().short == 0, 30, 0.3), probe.stat()
            after = holders()
            with ledger.lock:
                busy = {key_name(k) for k in ledger.removing | ledger.replacing}
            lost += [
                f"{key} on {sorted(nodes)}, {victim_id} killed"
                for key, nodes in before.items()
                if key in doubles and nodes - {victim_id} and key not in after and key not in busy
            ]
            if cycle == 0:
                cluster.add_agent(node_id=victim_id, zone="z", extra_args=disk_args(victim_id, disk))
            victim.stop()  # its log and segment; its directory is its successor's, and stays
        for t in writers:
            t.join(60)
        time.sleep(1.0)
        disk_used += sum(map(len, disk_replicas(probe).values()))
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a load thread hung"
    assert probe.stat().evictions == 0, "the load was sized to evict nothing"
    assert not lost, lost
    assert disk_used > 0, "nothing reached a disk tier: the load did not press the host tiers"
    # Puts failed only where a node died; a read that came back was one whole version put.
    wrong = [f for f in ledger.failures if not f.startswith(("put ", "replace "))]
    assert not wrong, wrong[:8]
    with ledger.lock:
        failed_replace = {int(f.split()[1]) for f in ledger.failures if f.startswith("replace ")}
    for key_id in ledger.live():
        try:
            got = probe.get(key_name(key_id))
        except KeyNotFound:
            # Only single copies go with their node (and keys whose replace failed mid-death).
            assert ledger.replicas[key_id] == 1 or key_id in failed_replace, f"key {key_id} (2 replicas) lost"
            continue
        assert check_bytes(key_id, got, ledger.versions[key_id]) is None, check_bytes(
            key_id, got, ledger.versions[key_id]
        )
    assert wait_until(lambda: agents_match_index(probe, NODES, cluster)[0], 15, 0.5), agents_match_index(
        probe, NODES, cluster
    )[1]
