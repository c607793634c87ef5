"""Review pass 9, chaos: many things at once, through the public SDK and real agent processes.

Three agents with small host arenas (low watermarks, spills to peers, one spilling over TCP),
writer threads putting objects of mixed sizes (4 KiB .. 4 MiB) aimed at the smallest agent with
one and two replicas, readers checking every byte of what was acknowledged, a remover and a
replacer (once sized to fit, once overfilled so that the agents evict); then the same with the
agent holding second replicas SIGKILLed midway, and with the spilling agent SIGKILLed; a client
closed under its own load; prefix chains stored and loaded under pressure.

Every value describes itself (key id, version and size in its first 16 bytes, the rest a slice of
a fixed random pool chosen by them), so a torn read, a read of freed or reused memory and a read of
another object all fail the byte comparison. Seeds are fixed. The one defect the pass found (a
lookup racing close() reopened Redis connections the closed client then held) is fixed: its test
is the last one.
"""

from __future__ import annotations

import gc
import os
import random
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
from helpers import wait_until

from mooncake_store import Client, KeyNotFound, LocalCluster, MooncakeError, connect
from mooncake_store.tiers.host import SHM_DIR

KiB = 1 << 10
MiB = 1 << 20

POOL = np.random.default_rng(20261130).integers(0, 256, 9 * MiB, dtype=np.uint8)
SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 2 * MiB, 4 * MiB]
SIZE_WEIGHTS = [0.2, 0.15, 0.15, 0.15, 0.15, 0.1, 0.1]
WATERMARKS = ["--high-watermark", "0.8", "--low-watermark", "0.5"]


def value_of(key_id: int, version: int, size: int) -> np.ndarray:
    """The bytes of version ``version`` of key ``key_id``: a header and a slice of POOL."""
    start = (key_id * 7919 + version * 104_729) % (4 * MiB)
    value = POOL[start : start + size].copy()
    value[:16] = np.frombuffer(struct.pack("<IIQ", key_id, version, size), np.uint8)
    return value


def typed(key_id: int, raw: np.ndarray) -> np.ndarray:
    """Some keys as other dtypes and shapes (the store keeps them)."""
    if key_id % 3 == 1:
        return raw.view(np.int32)
    if key_id % 3 == 2:
        return raw.view(np.float16).reshape(-1, 128)
    return raw


def check_bytes(key_id: int, got: np.ndarray | memoryview, versions: set[int]) -> str | None:
    """None when ``got`` is exactly one version of key ``key_id`` that was put, else what is wrong."""
    raw = np.frombuffer(got, np.uint8) if isinstance(got, memoryview) else np.ascontiguousarray(got).view(np.uint8)
    raw = raw.reshape(-1)
    if raw.size < 16:
        return f"key {key_id}: {raw.size} B read"
    kid, version, size = struct.unpack("<IIQ", raw[:16].tobytes())
    if kid != key_id or size != raw.size:
        return f"key {key_id}: header says key {kid} size {size}, read {raw.size} B"
    if version not in versions:
        return f"key {key_id}: version {version} was never put (put: {sorted(versions)})"
    if not np.array_equal(raw, value_of(key_id, version, size)):
        bad = int(np.flatnonzero(raw != value_of(key_id, version, size))[0])
        return f"key {key_id} v{version}: wrong bytes from offset {bad} of {size}"
    return None


@dataclass
class Ledger:
    """What the writers were told: acknowledged keys (and the versions put), removals."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: dict[int, int] = field(default_factory=dict)  # key id -> size
    versions: dict[int, set[int]] = field(default_factory=dict)  # key id -> versions ever attempted
    replicas: dict[int, int] = field(default_factory=dict)
    removing: set[int] = field(default_factory=set)  # a remove was started: a miss is allowed
    replacing: set[int] = field(default_factory=set)  # a replace is under way: not removed meanwhile
    failures: list[str] = field(default_factory=list)
    misses: dict[int, str] = field(default_factory=dict)  # never-removed keys a read did not find
    replaced: set[int] = field(default_factory=set)  # keys a replace put again
    gone_at_remove: set[int] = field(default_factory=set)  # keys a remove did not find
    counts: dict[str, int] = field(default_factory=dict)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def bump(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def live(self) -> list[int]:
        with self.lock:
            return [k for k in self.acked if k not in self.removing]


def key_name(key_id: int) -> str:
    return f"chaos/{key_id:05d}"


def add_agents(cluster: LocalCluster, *, zones: tuple[str, str, str] = ("z", "z", "z"), big: int = 48) -> None:
    """agent-0: 24 MiB, spills over TCP; agent-1: ``big`` MiB; agent-2: 32 MiB; watermarks 0.8/0.5."""
    cluster.add_agent(
        node_id="agent-0", zone=zones[0], extra_args=["--host-bytes", str(24 * MiB), "--no-spill-shm", *WATERMARKS]
    )
    cluster.add_agent(node_id="agent-1", zone=zones[1], extra_args=["--host-bytes", str(big * MiB), *WATERMARKS])
    cluster.add_agent(node_id="agent-2", zone=zones[2], extra_args=["--host-bytes", str(32 * MiB), *WATERMARKS])


def writer_loop(
    client: Client,
    ledger: Ledger,
    first_id: int,
    count: int,
    seed: int,
    stop: threading.Event,
    r2_share: float,
    pause_s: float = 0.005,
) -> None:
    rng = random.Random(seed)
    n = -1
    while n + 1 < count:
        n += 1
        if stop.is_set():
            return
        key_id = first_id + n
        size = rng.choices(SIZES, SIZE_WEIGHTS)[0]
        replicas = 2 if rng.random() < r2_share else 1
        with ledger.lock:
            ledger.versions.setdefault(key_id, set()).add(0)
        t0 = time.monotonic()
        try:
            if rng.random() < 0.3 and n + 1 < count:
                # A batch of two, the second key the next id.
                size2 = rng.choices(SIZES[:5])[0]
                with ledger.lock:
                    ledger.versions.setdefault(key_id + 1, set()).add(0)
                client.put_many(
                    {
                        key_name(key_id): typed(key_id, value_of(key_id, 0, size)),
                        key_name(key_id + 1): typed(key_id + 1, value_of(key_id + 1, 0, size2)),
                    },
                    replicas=replicas,
                    preferred_node="agent-0",
                )
                with ledger.lock:
                    ledger.acked[key_id], ledger.acked[key_id + 1] = size, size2
                    ledger.replicas[key_id] = ledger.replicas[key_id + 1] = replicas
                ledger.bump("puts", 2)
                n += 1  # the batch's second key is taken
                continue
            client.put(
                key_name(key_id), typed(key_id, value_of(key_id, 0, size)), replicas=replicas, preferred_node="agent-0"
            )
            with ledger.lock:
                ledger.acked[key_id] = size
                ledger.replicas[key_id] = replicas
            ledger.bump("puts")
        except MooncakeError as exc:
            ledger.bump("put_errors")
            ledger.fail(f"put {key_id} ({size} B, r{replicas}) after {time.monotonic() - t0:.1f} s: {exc!r}")
        time.sleep(pause_s)


def reader_loop(
    client: Client,
    ledger: Ledger,
    seed: int,
    stop: threading.Event,
    allowed_miss: Callable[[int, str], bool],
    pause_s: float = 0.0,
) -> None:
    rng = random.Random(seed)
    out = np.empty(4 * MiB, np.uint8)
    while not stop.wait(pause_s):
        live = ledger.live()
        if not live:
            time.sleep(0.02)
            continue
        if rng.random() < 0.5:
            ids = rng.sample(live, min(4, len(live)))
            names = [key_name(k) for k in ids] + ["chaos/never-put"]
            try:
                got = client.get_many(names)
            except MooncakeError as exc:
                if not all([allowed_miss(k, f"get_many raised {exc!r}") for k in ids]):
                    ledger.fail(f"get_many {ids}: {exc!r}")
                continue
            if got[-1] is not None:
                ledger.fail("get_many: a key never put came back")
            for key_id, arr in zip(ids, got[:-1], strict=True):
                if arr is None:
                    if not allowed_miss(key_id, "get_many: None"):
                        ledger.fail(f"get_many: key {key_id} missing, never removed")
                    continue
                with ledger.lock:
                    versions = set(ledger.versions[key_id])
                problem = check_bytes(key_id, arr, versions)
                if problem:
                    ledger.fail("get_many: " + problem)
            ledger.bump("gets", len(ids))
        else:
            key_id = rng.choice(live)
            try:
                n = client.get_into(key_name(key_id), out)
            except KeyNotFound:
                if not allowed_miss(key_id, "get_into: KeyNotFound"):
                    ledger.fail(f"get_into: KeyNotFound for key {key_id}, never removed")
                continue
            except MooncakeError as exc:
                if not allowed_miss(key_id, f"get_into raised {exc!r}"):
                    ledger.fail(f"get_into {key_id}: {exc!r}")
                continue
            with ledger.lock:
                versions = set(ledger.versions[key_id])
            problem = check_bytes(key_id, out[:n], versions)
            if problem:
                ledger.fail("get_into: " + problem)
            ledger.bump("gets")


def remover_loop(client: Client, ledger: Ledger, seed: int, stop: threading.Event, every_s: float = 0.15) -> None:
    rng = random.Random(seed)
    while not stop.wait(every_s):
        live = ledger.live()
        if len(live) < 6 or rng.random() < 0.4:
            continue
        with ledger.lock:
            choices = [k for k in live if k not in ledger.replacing]
            if not choices:
                continue
            key_id = rng.choice(choices)
            ledger.removing.add(key_id)
        try:
            if not client.remove(key_name(key_id)):
                with ledger.lock:
                    ledger.misses.setdefault(key_id, "remove found nothing")
                    ledger.gone_at_remove.add(key_id)
            ledger.bump("removes")
        except MooncakeError as exc:
            ledger.fail(f"remove {key_id}: {exc!r}")


def replacer_loop(client: Client, ledger: Ledger, seed: int, stop: threading.Event) -> None:
    """Replaces live keys with a new version of the same size (same replica count)."""
    rng = random.Random(seed)
    while not stop.wait(0.2):
        live = ledger.live()
        if not live:
            continue
        with ledger.lock:
            choices = [k for k in live if k not in ledger.removing]
            if not choices:
                continue
            key_id = rng.choice(choices)
            ledger.replacing.add(key_id)
            size, replicas = ledger.acked[key_id], ledger.replicas[key_id]
            version = max(ledger.versions[key_id]) + 1
            ledger.versions[key_id].add(version)
        try:
            client.put(
                key_name(key_id),
                typed(key_id, value_of(key_id, version, size)),
                replicas=replicas,
                preferred_node="agent-0",
            )
            ledger.bump("replaces")
            with ledger.lock:
                ledger.replaced.add(key_id)
        except MooncakeError as exc:
            ledger.fail(f"replace {key_id} v{version}: {exc!r}")
        finally:
            with ledger.lock:
                ledger.replacing.discard(key_id)


def run_threads(
    threads: list[threading.Thread], writers: list[threading.Thread], stop: threading.Event, linger_s: float
) -> None:
    """Start all; wait for the writers, let the rest run ``linger_s`` more, stop and join."""
    for t in threads:
        t.start()
    for t in writers:
        t.join(60)
    time.sleep(linger_s)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a load thread hung"


def index_use(client: Client) -> tuple[dict[str, int], dict[str, int]]:
    """Per node: bytes and objects the index names there (every record's replicas)."""
    used: dict[str, int] = {}
    objs: dict[str, int] = {}
    for listing in client.index.list_keys("*"):
        for r in listing.replicas:
            used[r.node_id] = used.get(r.node_id, 0) + -(-r.size_bytes // 64) * 64
            objs[r.node_id] = objs.get(r.node_id, 0) + 1
    return used, objs


def agents_match_index(client: Client, nodes: list[str]) -> tuple[bool, str]:
    """Each agent's published use equals what the index names on it: no reservation, grave or
    spill copy left behind."""
    used, objs = index_use(client)
    cluster_stat = client.stat()
    stat = {n.node_id: n for n in cluster_stat.nodes}
    listed = len(client.index.list_keys("*"))
    rows = [f"objects: stat {cluster_stat.objects}, listed {listed}"]
    ok = cluster_stat.objects == listed
    for node_id in nodes:
        host = stat[node_id].tiers[0]
        rows.append(
            f"{node_id}: agent {host.used_bytes} B/{host.objects} obj, "
            f"index {used.get(node_id, 0)} B/{objs.get(node_id, 0)} obj (nobj {stat[node_id].objects})"
        )
        ok = ok and host.used_bytes == used.get(node_id, 0) and host.objects == objs.get(node_id, 0)
        ok = ok and stat[node_id].objects == objs.get(node_id, 0)
    return ok, "; ".join(rows)


def spill_totals(client: Client, nodes: list[str]) -> tuple[int, int, int]:
    stat = {n.node_id: n for n in client.stat().nodes}
    tiers = [stat[n].tiers[0] for n in nodes if n in stat]
    return sum(t.spills_out for t in tiers), sum(t.spills_in for t in tiers), sum(t.evictions for t in tiers)


# ---- 1: writers, readers, a remover and a replacer against three small agents ----------------
def test_mixed_load_on_small_arenas_reads_only_whole_acknowledged_values(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0, reserve_timeout_s=3.0)
    add_agents(cluster)
    nodes = ["agent-0", "agent-1", "agent-2"]
    ledger = Ledger()
    stop = threading.Event()
    writer = make_client(cluster, lease_ms=400, timeout_s=20)
    writer2 = make_client(cluster, lease_ms=400, timeout_s=20)
    readers = [make_client(cluster, lease_ms=400), make_client(cluster, lease_ms=400, transports=("tcp",))]
    mutator = make_client(cluster, lease_ms=400, timeout_s=20)
    evicted = [0]

    def allowed_miss(key_id: int, why: str) -> bool:
        with ledger.lock:
            return key_id in ledger.removing or evicted[0] > 0

    writers = [
        threading.Thread(target=writer_loop, args=(writer, ledger, 0, 26, 11, stop, 0.35)),
        threading.Thread(target=writer_loop, args=(writer2, ledger, 1000, 26, 12, stop, 0.35)),
    ]
    threads = [
        *writers,
        *(
            threading.Thread(target=reader_loop, args=(c, ledger, 21 + i, stop, allowed_miss))
            for i, c in enumerate(readers)
        ),
        threading.Thread(target=remover_loop, args=(mutator, ledger, 31, stop)),
        threading.Thread(target=replacer_loop, args=(mutator, ledger, 41, stop)),
    ]
    run_threads(threads, writers, stop, linger_s=2.0)
    evicted[0] = spill_totals(writer, nodes)[2]
    assert not ledger.failures, (ledger.counts, ledger.failures[:8])
    # Every acknowledged key not removed reads back whole, after the load.
    for key_id in ledger.live():
        try:
            got = writer.get(key_name(key_id))
        except KeyNotFound:
            assert evicted[0] > 0, f"key {key_id} lost with no eviction counted"
            continue
        assert check_bytes(key_id, got, ledger.versions[key_id]) is None, check_bytes(
            key_id, got, ledger.versions[key_id]
        )
    assert not ledger.misses, f"keys never removed were missing: {ledger.misses}"
    for key_id in list(ledger.removing):
        assert not writer.exists(key_name(key_id)), f"removed key {key_id} is back"
    # Counters: every spill counted out by its sender was counted in by its receiver.
    assert wait_until(lambda: (lambda t: t[0] == t[1])(spill_totals(writer, nodes)), 8), spill_totals(writer, nodes)
    out, _, evictions = spill_totals(writer, nodes)
    assert evictions == 0, f"{evictions} evictions: the load was sized to need none"
    # Once reservations time out (3 s) and leases end, each agent holds exactly what the index names.
    assert wait_until(lambda: agents_match_index(writer, nodes)[0], 12, 0.5), agents_match_index(writer, nodes)[1]
    assert ledger.counts.get("puts", 0) >= 40 and ledger.counts.get("gets", 0) > 0, ledger.counts
    assert out > 0, "nothing spilled: the load did not press agent-0"


def test_overfilled_small_arenas_lose_only_what_they_count_as_evicted(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """More than the cluster holds, short leases and a short reservation timeout: objects may be
    evicted (this is a cache), but never more than the agents count, never a wrong byte, and
    spill and memory accounting still add up."""
    cluster = make_cluster(0, reserve_timeout_s=1.5)
    add_agents(cluster, big=32)
    nodes = ["agent-0", "agent-1", "agent-2"]
    ledger = Ledger()
    stop = threading.Event()
    writers_c = [make_client(cluster, lease_ms=150, timeout_s=20) for _ in range(3)]
    readers = [make_client(cluster, lease_ms=150), make_client(cluster, lease_ms=150, transports=("tcp",))]
    mutator = make_client(cluster, lease_ms=150, timeout_s=20)

    probe = make_client(cluster)

    def allowed_miss(key_id: int, why: str) -> bool:
        r, pfx = probe.index.redis, probe.index.prefix
        rec = r.hget(pfx + "o:" + key_name(key_id), "replicas")
        hb = r.zrange(pfx + "hb", 0, -1, withscores=True)
        now = probe.index.server_time_ms()
        with ledger.lock:
            if key_id not in ledger.removing:
                ledger.misses.setdefault(
                    key_id,
                    f"{why} at {time.monotonic() - t_start:.2f} s; record now {rec}; "
                    f"heartbeat deadlines in ms {[(n, int(d - now)) for n, d in hb]}",
                )
            return True

    writers = [
        threading.Thread(target=writer_loop, args=(c, ledger, 1000 * i, 30, 81 + i, stop, 0.3))
        for i, c in enumerate(writers_c)
    ]
    threads = [
        *writers,
        *(
            threading.Thread(target=reader_loop, args=(c, ledger, 91 + i, stop, allowed_miss, 0.03))
            for i, c in enumerate(readers)
        ),
        threading.Thread(target=remover_loop, args=(mutator, ledger, 95, stop, 0.8)),
        threading.Thread(target=replacer_loop, args=(mutator, ledger, 96, stop)),
    ]
    t_start = time.monotonic()
    run_threads(threads, writers, stop, linger_s=1.5)
    client = writers_c[0]
    assert not ledger.failures, (ledger.counts, ledger.failures[:8])
    lost = []
    for key_id in ledger.live():
        try:
            got = client.get(key_name(key_id))
        except KeyNotFound:
            lost.append(key_id)
            continue
        assert check_bytes(key_id, got, ledger.versions[key_id]) is None, check_bytes(
            key_id, got, ledger.versions[key_id]
        )
    assert wait_until(lambda: (lambda t: t[0] == t[1])(spill_totals(client, nodes)), 8), spill_totals(client, nodes)
    evictions = client.stat().evictions  # objects the cluster dropped (no live replica left)
    removed_missing = sorted(ledger.gone_at_remove)
    lost += removed_missing  # evicted before the remove came
    # A key missed by a read and present at the end was put again after its eviction, by the
    # replacer; any other came back from nowhere: a read missed an object that was there.
    transient = sorted(set(ledger.misses) - set(lost) - ledger.replaced - ledger.removing)
    assert len(lost) <= evictions, f"{len(lost)} keys lost, {evictions} evictions counted: {lost[:10]}"
    assert not transient, (
        f"{[(k, ledger.misses[k]) for k in transient]}: reads missed keys that were neither removed nor "
        "evicted (present at the end, never put again)"
    )
    if evictions == 0:
        assert not ledger.misses, f"reads missed keys never removed, no eviction counted: {sorted(ledger.misses)[:10]}"
    assert wait_until(lambda: agents_match_index(client, nodes)[0], 12, 0.5), agents_match_index(client, nodes)[1]


# ---- 2: the same while the agent holding second replicas is SIGKILLed -----------------------
def test_kill_of_second_replica_agent_under_load_loses_nothing_with_a_survivor(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    # agent-2 sits alone in another zone: second replicas go there, and spills from agent-0 go to
    # agent-1 (same zone first; agent-1 is big enough to take them all).
    cluster = make_cluster(0, reserve_timeout_s=3.0, heartbeat_ttl_s=2.0)
    add_agents(cluster, zones=("za", "za", "zb"), big=64)
    ledger = Ledger()
    stop = threading.Event()
    writer = make_client(cluster, lease_ms=400, timeout_s=20)
    readers = [
        make_client(cluster, lease_ms=400, timeout_s=4),
        make_client(cluster, lease_ms=400, timeout_s=4, transports=("tcp",)),
    ]
    only_on_victim: set[int] = set()
    killed = threading.Event()

    def allowed_miss(key_id: int, why: str) -> bool:
        with ledger.lock:
            return key_id in ledger.removing or key_id in only_on_victim

    snapshot_ids: set[int] = set()
    writers = [threading.Thread(target=writer_loop, args=(writer, ledger, 0, 40, 51, stop, 0.6))]
    threads = [
        *writers,
        *(
            threading.Thread(target=reader_loop, args=(c, ledger, 61 + i, stop, allowed_miss))
            for i, c in enumerate(readers)
        ),
        threading.Thread(target=remover_loop, args=(make_client(cluster, lease_ms=400), ledger, 71, stop)),
    ]
    for t in threads:
        t.start()
    victim = cluster.agent("agent-2")
    try:
        assert wait_until(lambda: len(ledger.acked) >= 16, 40), ledger.counts
        listing = {x.key: x for x in writer.index.list_keys("chaos/*")}
        with ledger.lock:
            for key_id in ledger.acked:
                entry = listing.get(key_name(key_id))
                if entry is not None:
                    snapshot_ids.add(key_id)
                    if {r.node_id for r in entry.replicas} <= {"agent-2"}:
                        only_on_victim.add(key_id)
        killed.set()
        victim.kill()
        (SHM_DIR / victim.shm_name).unlink(missing_ok=True)  # as a host failure would
        for t in writers:
            t.join(60)
        time.sleep(3.0)  # past the heartbeat deadline: the reaper runs
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    survivors = [k for k in snapshot_ids if k not in only_on_victim and k not in ledger.removing]
    lost = []
    for key_id in survivors:
        try:
            problem = check_bytes(key_id, writer.get(key_name(key_id)), ledger.versions[key_id])
            assert problem is None, problem
        except KeyNotFound:
            lost.append(key_id)
    assert not lost, f"keys with a replica off agent-2 lost: {lost} (only on agent-2: {sorted(only_on_victim)})"
    # Failures during the load: only puts that lost their target (they are not acknowledged).
    assert wait_until(lambda: "agent-2" not in writer.index.nodes(), 10), "the dead agent was not reaped"
    survivors_nodes = ["agent-0", "agent-1"]
    assert wait_until(lambda: agents_match_index(writer, survivors_nodes)[0], 12, 0.5), agents_match_index(
        writer, survivors_nodes
    )[1]
    reads = [f for f in ledger.failures if not f.startswith("put ")]
    assert not reads, (ledger.counts, reads[:8])


# ---- 3: close() racing puts and gets of its own client ---------------------------------------
def own_sockets_to(ports: set[int]) -> dict[int, int]:
    """Established TCP sockets of this process whose peer is one of ``ports`` on loopback."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            remote, state, inode = parts[2], parts[3], parts[9]
            port = int(remote.rsplit(":", 1)[1], 16)
            if state == "01" and inode in inodes and port in ports:
                count[port] = count.get(port, 0) + 1
    return count


@dataclass
class CloseRound:
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: threading.Event = field(default_factory=threading.Event)
    stored: dict[str, np.ndarray] = field(default_factory=dict)  # puts that returned
    refused: dict[str, str] = field(default_factory=dict)  # puts that raised: key -> error
    problems: list[str] = field(default_factory=list)
    ops_after_close: int = 0

    def problem(self, what: str) -> None:
        with self.lock:
            self.problems.append(what)


def close_round(
    cluster: LocalCluster, checker: Client, seed_values: dict[str, np.ndarray], seed: int, delay_s: float
) -> CloseRound:
    state = CloseRound()
    client = connect(cluster.redis_url, namespace=cluster.namespace, lease_ms=300, timeout_s=10)
    rng = random.Random(seed)

    def classify(op: str, exc: BaseException) -> None:
        if not isinstance(exc, MooncakeError):
            state.problem(f"{op}: not a MooncakeError: {exc!r}")
        elif state.closing.is_set() and not isinstance(exc, KeyNotFound) and str(exc) != "client is closed":
            state.problem(f"{op} under close(): {exc!r} (README: 'client is closed')")
        elif not state.closing.is_set():
            state.problem(f"{op} before close(): {exc!r}")

    def putter(t: int) -> None:
        r = random.Random(seed * 100 + t)
        n = 0
        while n < 150:  # bounded: no eviction may blur what a put left behind
            n += 1
            key = f"close/{seed}/{t}/{n}"
            key_id = seed * 10_000 + t * 1000 + n
            value = value_of(key_id, 0, r.choice(SIZES[:3]))
            time.sleep(0.01)
            try:
                if t == 2:
                    fut: Future[None] = client.put_async(key, value, replicas=r.choice([1, 2]))
                    fut.result(30)
                else:
                    client.put(key, value, replicas=r.choice([1, 2]))
                with state.lock:
                    state.stored[key] = value
            except BaseException as exc:
                with state.lock:
                    state.refused[key] = repr(exc)
                classify(f"put {key}", exc)
                if state.closing.is_set():
                    return
                if not isinstance(exc, MooncakeError):
                    return

    def reader(t: int) -> None:
        r = random.Random(seed * 100 + 50 + t)
        out = np.empty(4 * MiB, np.uint8)
        names = sorted(seed_values)
        while True:
            key = r.choice(names)
            try:
                if r.random() < 0.5:
                    got = client.get_many([key, r.choice(names)])
                    for k, arr in zip([key], got[:1], strict=True):
                        if arr is None or not np.array_equal(arr.view(np.uint8).reshape(-1), seed_values[k]):
                            state.problem(f"get_many {k}: wrong or missing bytes")
                else:
                    n = client.get_into(key, out)
                    if not np.array_equal(out[:n], seed_values[key]):
                        state.problem(f"get_into {key}: wrong bytes")
            except BaseException as exc:
                classify(f"get {key}", exc)
                if state.closing.is_set() or not isinstance(exc, MooncakeError):
                    return

    threads = [threading.Thread(target=putter, args=(t,)) for t in range(3)]
    threads += [threading.Thread(target=reader, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    time.sleep(delay_s + rng.random() * 0.2)
    state.closing.set()
    started = time.monotonic()
    client.close()
    took = time.monotonic() - started
    for t in threads:
        t.join(15)
    if any(t.is_alive() for t in threads):
        state.problem("a thread was still running 15 s after close()")
    if took > 5:
        state.problem(f"close() took {took:.1f} s")
    return state


def test_close_racing_puts_and_gets_keeps_the_close_contract(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0, reserve_timeout_s=2.0)
    add_agents(cluster)
    nodes = ["agent-0", "agent-1", "agent-2"]
    checker = make_client(cluster, lease_ms=300)
    seed_values = {f"seed/{i}": value_of(90_000 + i, 0, SIZES[i % 6]) for i in range(12)}
    checker.put_many(seed_values)
    ports = {int(a.endpoint.rsplit(":", 1)[1]) for a in cluster.agents}
    rounds = []
    problems: list[str] = []
    for seed, delay in ((1, 0.3), (2, 0.9), (3, 1.6)):
        # Agent connections only: the Redis ones have a test of their own (below).
        before = own_sockets_to(ports)
        r = close_round(cluster, checker, seed_values, seed, delay)
        rounds.append(r)
        problems += r.problems
        gc.collect()
        after = own_sockets_to(ports)
        if after != before:
            problems.append(f"round {seed}: agent sockets of the closed client still open: {before} -> {after}")
        # Puts that returned are stored whole; puts that raised stored nothing.
        for key, value in r.stored.items():
            try:
                got = checker.get(key)
            except KeyNotFound:
                problems.append(f"{key}: acknowledged put, KeyNotFound")
                continue
            if not np.array_equal(got.view(np.uint8).reshape(-1), value):
                problems.append(f"{key}: acknowledged put reads back wrong")
        for key, why in r.refused.items():
            if checker.exists(key):
                problems.append(f"{key}: put raised {why} but the key is stored")
        checker.remove_many(list(r.stored))
    assert not problems, problems[:8]
    assert sum(len(r.stored) for r in rounds) > 0
    assert spill_totals(checker, nodes)[2] == 0, "evictions: the load was sized to need none"
    # The cut puts' reservations are reclaimed at the agents' timeout (2 s).
    assert wait_until(lambda: agents_match_index(checker, nodes)[0], 12, 0.5), agents_match_index(checker, nodes)[1]


def test_a_lookup_racing_close_leaves_no_index_connection_open(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A reader thread has passed the client's open check and is about to look its key up when
    another thread closes the client (placed here by holding the lookup until close() returned;
    without the hold, four threads looping get() left a socket open in 3 of 8 closes). The get
    ends with "client is closed", as it should, but the lookup it made after close() opened a
    Redis connection that nothing closes: the closed client keeps a socket to the server."""
    cluster = make_cluster(1, host_bytes=8 * MiB)
    make_client(cluster).put("k", np.arange(1000, dtype=np.uint8))
    redis_port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
    gc.collect()
    before = own_sockets_to({redis_port}).get(redis_port, 0)
    client = connect(cluster.redis_url, namespace=cluster.namespace)
    assert client.exists("k")
    at_lookup, closed = threading.Event(), threading.Event()
    real_lookup = client.index.lookup

    def lookup_after_close(keys: list[str], *, lease_ms: int) -> object:
        at_lookup.set()
        closed.wait(10)
        return real_lookup(keys, lease_ms=lease_ms)

    client.index.lookup = lookup_after_close  # type: ignore[method-assign]
    outcome: list[str] = []

    def read() -> None:
        try:
            client.get("k")
            outcome.append("returned")
        except MooncakeError as exc:
            outcome.append(str(exc))

    reader = threading.Thread(target=read)
    reader.start()
    assert at_lookup.wait(10)
    client.close()
    closed.set()
    reader.join(10)
    assert outcome == ["client is closed"], outcome
    gc.collect()
    after = own_sockets_to({redis_port}).get(redis_port, 0)
    assert after == before, (
        f"{after - before} Redis connection(s) of the closed client still open: the lookup after close() "
        "reopened one and kept it"
    )


def test_kill_of_the_spilling_agent_mid_load_leaves_peers_clean_and_replicas_readable(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """agent-0 (TCP spills) is SIGKILLed while it is under pressure and spilling: the reservations
    it held on its peers are reclaimed by them (their use comes back to what the index names), and
    every object with a replica off agent-0 reads back whole."""
    cluster = make_cluster(0, reserve_timeout_s=2.0, heartbeat_ttl_s=2.0)
    add_agents(cluster, big=48)
    ledger = Ledger()
    stop = threading.Event()
    writer = make_client(cluster, lease_ms=300, timeout_s=10)
    readers = [
        make_client(cluster, lease_ms=300, timeout_s=4),
        make_client(cluster, lease_ms=300, timeout_s=4, transports=("tcp",)),
    ]
    victim = cluster.agent("agent-0")
    killed = threading.Event()

    def allowed_miss(key_id: int, why: str) -> bool:
        return killed.is_set() or key_id in ledger.removing

    writers = [threading.Thread(target=writer_loop, args=(writer, ledger, 0, 44, 101, stop, 0.4, 0.08))]
    threads = [
        *writers,
        *(
            threading.Thread(target=reader_loop, args=(c, ledger, 111 + i, stop, allowed_miss, 0.01))
            for i, c in enumerate(readers)
        ),
    ]
    for t in threads:
        t.start()
    try:
        # Midway, while agent-0 is past its high watermark and moving objects out.
        def spilling() -> bool:
            # Replicas off agent-0 of keys put with one: spilled (the index says so at once).
            with ledger.lock:
                single = {key_name(k) for k, n in ledger.replicas.items() if n == 1}
            return any(
                x.key in single and x.replicas[0].node_id != "agent-0" for x in writer.index.list_keys("chaos/*")
            )

        wait_until(spilling, 8, 0.1)  # else later in the load: the kill is checked either way
        killed.set()
        victim.kill()
        (SHM_DIR / victim.shm_name).unlink(missing_ok=True)
        for t in writers:
            t.join(60)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    before_kill = [f for f in ledger.failures if not f.startswith("put ")]
    assert not before_kill, before_kill[:5]
    assert wait_until(lambda: "agent-0" not in writer.index.nodes(), 10), "the dead agent was not reaped"
    # Every object the index still lists reads back whole; those with two replicas are all there.
    listed = {x.key for x in writer.index.list_keys("chaos/*")}
    for key_id in ledger.live():
        name = key_name(key_id)
        if name in listed:
            problem = check_bytes(key_id, writer.get(name), ledger.versions[key_id])
            assert problem is None, problem
        else:
            assert ledger.replicas[key_id] == 1, f"key {key_id} had two replicas and is gone after one node died"
    survivors = ["agent-1", "agent-2"]
    assert wait_until(lambda: agents_match_index(writer, survivors)[0], 12, 0.5), agents_match_index(writer, survivors)[
        1
    ]


# ---- 4: prefix chains under pressure, stored and loaded concurrently -----------------------
CHUNK_TOKENS = 16
CHUNK_BYTES = 256 * KiB


def doc_tokens(doc: int, chunks: int = 24) -> np.ndarray:
    """Documents 2f and 2f+1 share their first 8 chunks (family f); the rest is their own."""
    family = np.random.default_rng(1000 + doc // 2).integers(0, 32000, 8 * CHUNK_TOKENS)
    own = np.random.default_rng(2000 + doc).integers(0, 32000, (chunks - 8) * CHUNK_TOKENS)
    return np.concatenate([family, own]).astype(np.int64)


def chunk_value(tokens: np.ndarray, i: int) -> np.ndarray:
    """Chunk i of a prompt: a function of the prompt's tokens up to its end (as its key is)."""
    import zlib

    ident = zlib.crc32(tokens[: (i + 1) * CHUNK_TOKENS].tobytes()) & 0x7FFFFFFF
    return value_of(ident, 0, CHUNK_BYTES)


def test_prefix_chains_under_pressure_load_whole_pinned_chunks(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Writers store eight documents (pairs share a prefix; 40 MiB in all) into two 16 MiB agents, more than they
    hold, while loaders load them and hold their hits: every chunk a hit returns is whole, a held
    hit's chunks stay stored (pinned), and what match() reports is loadable."""
    from mooncake_store import PrefixCache

    cluster = make_cluster(0, reserve_timeout_s=2.0)
    for i in range(2):
        cluster.add_agent(node_id=f"agent-{i}", extra_args=["--host-bytes", str(16 * MiB), *WATERMARKS])
    failures: list[str] = []
    stop = threading.Event()
    counts = {"stored": 0, "loaded": 0, "hits": 0}
    docs = {d: doc_tokens(d) for d in range(8)}

    def writer(t: int) -> None:
        client = make_client(cluster, lease_ms=200, timeout_s=10)
        cache = PrefixCache(client, "chaos-model/f16", chunk_tokens=CHUNK_TOKENS, pin_lease_s=5)
        rng = random.Random(200 + t)
        try:
            for _ in range(12):
                if stop.is_set():
                    return
                d = rng.randrange(8)
                tokens = docs[d]
                try:
                    counts["stored"] += cache.store(tokens, lambda i, tokens=tokens: chunk_value(tokens, i))
                except MooncakeError as exc:
                    failures.append(f"store doc {d}: {exc!r}")
                time.sleep(0.05)
        finally:
            cache.close()

    def loader(t: int) -> None:
        client = make_client(cluster, lease_ms=200, timeout_s=10, transports=("tcp",) if t else None)
        cache = PrefixCache(client, "chaos-model/f16", chunk_tokens=CHUNK_TOKENS, pin_lease_s=5)
        rng = random.Random(300 + t)
        try:
            while not stop.is_set():
                d = rng.randrange(8)
                tokens = docs[d]
                try:
                    with cache.load(tokens) as hit:
                        counts["loaded"] += 1
                        counts["hits"] += hit.num_chunks
                        for i, chunk in enumerate(hit.chunks):
                            if not np.array_equal(np.asarray(chunk).view(np.uint8).reshape(-1), chunk_value(tokens, i)):
                                failures.append(f"doc {d} chunk {i}: wrong bytes")
                        time.sleep(0.05)  # held: pinned chunks must stay
                        for i, key in enumerate(hit.keys):
                            if not client.exists(key):
                                failures.append(f"doc {d} chunk {i}: gone while its hit pinned it")
                except MooncakeError as exc:
                    failures.append(f"load doc {d}: {exc!r}")
                time.sleep(0.02)
        finally:
            cache.close()

    writers = [threading.Thread(target=writer, args=(t,)) for t in range(2)]
    threads = [*writers, *(threading.Thread(target=loader, args=(t,)) for t in range(2))]
    run_threads(threads, writers, stop, linger_s=1.0)
    assert not failures, (counts, failures[:8])
    # Chains are prefix-closed: each document matches a run of chunks that all read back whole.
    client = make_client(cluster, lease_ms=200)
    cache = PrefixCache(client, "chaos-model/f16", chunk_tokens=CHUNK_TOKENS)
    try:
        for d, tokens in docs.items():
            n = cache.match(tokens) // CHUNK_TOKENS
            keys = cache.keys(tokens)
            for i, got in enumerate(client.get_many(keys[:n])):
                assert got is not None, f"doc {d}: match says {n} chunks, chunk {i} is gone"
                assert np.array_equal(got.view(np.uint8).reshape(-1), chunk_value(tokens, i)), (d, i)
    finally:
        cache.close()
    assert counts["stored"] > 0 and counts["hits"] > 0, counts
    assert wait_until(lambda: agents_match_index(client, ["agent-0", "agent-1"])[0], 12, 0.5), agents_match_index(
        client, ["agent-0", "agent-1"]
    )[1]
