"""Review pass 9, chaos: many things at once, through the public SDK and real agent processes.

Three agents with small host arenas (low watermarks, spills to peers, one spilling over TCP),
writer threads putting objects of mixed sizes (4 KiB .. 4 MiB) aimed at the smallest agent with
one and two replicas, readers checking every byte of what was acknowledged, a remover and a
replacer (once sized to fit, once overfilled so that the agents evict); then the same with the
agent holding second replicas SIGKILLed midway, and with the spilling agent SIGKILLed; prefix
chains stored and loaded under pressure. A client closed under its own load is in
test_review_session9_close.py; the helpers both use are in chaos_kit.py.

Every value describes itself (key id, version and size in its first 16 bytes, the rest a slice of
a fixed random pool chosen by them), so a torn read, a read of freed or reused memory and a read of
another object all fail the byte comparison. Seeds are fixed.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import numpy as np
from chaos_kit import (
    WATERMARKS,
    KiB,
    Ledger,
    MiB,
    add_agents,
    agents_match_index,
    check_bytes,
    key_name,
    reader_loop,
    remover_loop,
    replacer_loop,
    run_threads,
    spill_totals,
    value_of,
    writer_loop,
)
from helpers import wait_until

from mooncake_store import Client, KeyNotFound, LocalCluster, MooncakeError
from mooncake_store.tiers.host import SHM_DIR


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
