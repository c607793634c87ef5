"""Shared by the chaos tests (test_review_session9_chaos.py, test_review_session9_close.py): values
that describe themselves, the ledger of what writers were told, the load loops, and the checks of
agents against the index."""

from __future__ import annotations

import random
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tier_audit import audit_tiers

from mooncake_store import Client, KeyNotFound, LocalCluster, MooncakeError

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
    preferred: str | None = "agent-0",
) -> None:
    """Puts keys ``first_id`` on, aimed at ``preferred`` (None: where placement says)."""
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
                    preferred_node=preferred,
                )
                with ledger.lock:
                    ledger.acked[key_id], ledger.acked[key_id + 1] = size, size2
                    ledger.replicas[key_id] = ledger.replicas[key_id + 1] = replicas
                ledger.bump("puts", 2)
                n += 1  # the batch's second key is taken
                continue
            client.put(
                key_name(key_id), typed(key_id, value_of(key_id, 0, size)), replicas=replicas, preferred_node=preferred
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


def agents_match_index(client: Client, nodes: list[str], cluster: LocalCluster | None = None) -> tuple[bool, str]:
    """Each agent's published use equals what the index names on it, tier by tier: no reservation,
    grave or spill copy left behind. A disk tier's chunk files are checked too (one per disk
    replica the index lists on the node, no temp file left) where ``cluster`` says its directory;
    a GPU tier where an agent has one (tier_audit.py)."""
    dirs = {a.node_id: a.disk_dir for a in cluster.agents if a.disk_dir and a.alive()} if cluster else None
    audit = audit_tiers(client, nodes, disk_dirs=dirs)
    return audit.ok, str(audit)


def spill_totals(client: Client, nodes: list[str]) -> tuple[int, int, int]:
    """(objects sent: spills out and re-replication copies, objects received: spills in, which
    counts both, evictions) over the nodes' first tiers. A copy a full node dropped is made again
    once a peer has room under its low watermark, so a cluster that lost no node copies too."""
    stat = {n.node_id: n for n in client.stat().nodes}
    tiers = [stat[n].tiers[0] for n in nodes if n in stat]
    sent = sum(t.spills_out + t.copies_out for t in tiers)
    return sent, sum(t.spills_in for t in tiers), sum(t.evictions for t in tiers)
