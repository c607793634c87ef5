"""Memory pressure end to end: spilling to a peer, demotion to disk and promotion back, eviction
of a full cluster, with real agents and readers running during the moves."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import host_use_since, node_row, wait_until
from index_audit import settled_audit

from mooncake_store import Client, KeyNotFound, LocalCluster, MooncakeError
from mooncake_store.agent.drains import WRITER_WAITS_S
from mooncake_store.config.tree import AgentConfig

MiB = 1 << 20


def value_for(key: str, size: int = MiB) -> np.ndarray:
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little") % (2**32)
    return np.random.default_rng(seed).integers(0, 255, size, dtype=np.uint8)


def pin(client: Client, key: str, ttl_ms: int = 120_000) -> None:
    """A pin as the prefix cache takes one: an entry with an expiry in the object's pins zset."""
    now_ms = client.index.server_time_ms()
    client.index.redis.zadd(client.index.prefix + "pins:" + key, {"test-pin": now_ms + ttl_ms})


def unpin(client: Client, keys: list[str]) -> None:
    """Release the pins ``pin`` took, all at once (one DEL)."""
    client.index.redis.delete(*(client.index.prefix + "pins:" + key for key in keys))


def replica_nodes(client: Client, key: str) -> list[tuple[str, str]]:
    meta = client.object_meta(key)
    assert meta is not None, key
    return [(r.node_id, str(r.tier)) for r in meta.replicas]


#: Agent A's spill path to a same-host peer: memcpy into its shared arena (the default), or TCP
#: WRITEs (as to a peer on another host).
SPILL_PATHS = pytest.mark.parametrize("spill_args", [[], ["--no-spill-shm"]], ids=["shm", "tcp"])


@SPILL_PATHS
def test_spill_to_peer_keeps_everything_readable(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], spill_args: list[str]
) -> None:
    cluster = make_cluster(0)
    cluster.add_agent(node_id="agent-0", extra_args=["--host-bytes", str(24 * MiB), *spill_args])
    cluster.add_agent(node_id="agent-1", extra_args=["--host-bytes", str(160 * MiB)])
    writer = make_client(cluster, lease_ms=300, timeout_s=20)
    hot_reader = make_client(cluster, lease_ms=3000)
    keys: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    writer.put("pinned", value_for("pinned"), preferred_node="agent-0")
    pin(writer, "pinned")
    writer.put("hot", value_for("hot"), preferred_node="agent-0")

    def keep_hot() -> None:
        while not stop.is_set():
            try:
                if not np.array_equal(hot_reader.get("hot"), value_for("hot")):
                    failures.append("hot: wrong bytes")
            except MooncakeError as exc:
                failures.append(f"hot: {exc!r}")
            time.sleep(0.05)

    def read_back(client: Client) -> None:
        rng = np.random.default_rng(7)
        while not stop.is_set():
            if not keys:
                time.sleep(0.01)
                continue
            key = keys[int(rng.integers(len(keys)))]
            try:
                if not np.array_equal(client.get(key), value_for(key)):
                    failures.append(f"{key}: wrong bytes")
            except KeyNotFound:
                failures.append(f"{key}: KeyNotFound for an object never removed")
            except MooncakeError as exc:
                failures.append(f"{key}: {exc!r}")

    threads = [
        threading.Thread(target=keep_hot),
        threading.Thread(target=read_back, args=(make_client(cluster, lease_ms=300),)),
    ]
    for t in threads:
        t.start()
    try:
        for i in range(72):  # three times agent-0's arena, all aimed at agent-0
            key = f"spill/{i:03d}"
            writer.put(key, value_for(key), preferred_node="agent-0")
            keys.append(key)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not failures, failures[:5]
    for key in keys:
        assert np.array_equal(writer.get(key), value_for(key)), key
    placed = {key: replica_nodes(writer, key)[0][0] for key in keys}
    assert list(placed.values()).count("agent-1") >= 40, placed
    # Which objects moved follows access recency (the random reader keeps warming some); the order
    # itself is unit-tested in tests/unit/test_eviction.py. Hot and pinned objects never move:
    assert replica_nodes(writer, "pinned") == [("agent-0", "host")]
    assert replica_nodes(writer, "hot") == [("agent-0", "host")]

    def host_stats() -> dict[str, object]:
        return {n.node_id: n.tiers[0] for n in writer.stat().nodes}

    # Counters reach the node table with the next heartbeat (every second).
    assert wait_until(
        lambda: host_stats()["agent-0"].spills_out >= 40 and host_stats()["agent-1"].spills_in >= 40,
        5,  # type: ignore[attr-defined]
    ), host_stats()
    assert host_stats()["agent-0"].evictions == 0  # type: ignore[attr-defined]
    assert not settled_audit(writer.index)


def test_disk_tier_demotes_promotes_and_cleans_up(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    cluster = make_cluster(0)
    agent = cluster.add_agent(
        node_id="agent-0",
        extra_args=["--host-bytes", str(16 * MiB), "--disk", str(tmp_path), "--disk-mem", str(256 * MiB)],
    )
    client = make_client(cluster, lease_ms=300, timeout_s=20)
    kv = {
        f"kv/{i:02d}": (np.random.default_rng(i).standard_normal(MiB // 2) * 0.05).astype(np.float16) for i in range(40)
    }
    for key, value in kv.items():
        client.put(key, value)
    puts_done = time.monotonic()
    # Where the host tier rests once the writes stop depends on where the last put fell in the
    # drain's cycle: drained to its low watermark (12 of these 1 MiB objects), the tier takes puts
    # again until one takes it past its high one (14.4), so it rests at 12, 13 or 14. It was 12
    # when the last puts landed during a drain, as they mostly do while the writer outruns the
    # drain; a wait for <= 12 MiB here ran out in a loaded run where the drain had kept up
    # (14 MiB, 26 demotions, the pressure loop idle). At rest the tier is at or under its high
    # watermark. Bounded generously: each demotion compresses its object, and on a loaded 2-core
    # machine 15 s ran out. The node's tiers in the message say where it stood.
    high = AgentConfig().high_watermark * 16 * MiB
    assert wait_until(lambda: host_use_since(client, puts_done) <= high, 60), client.stat().nodes[0]

    def disk_replicas() -> tuple[list[str], list[Path]]:
        """The objects the index has on disk and the chunk files on the disk, each read once."""
        on_disk = [k for k in kv if replica_nodes(client, k)[0][1] == "disk"]
        return on_disk, list((tmp_path / agent.node_id).rglob("*.mcz"))

    def settled() -> bool:
        """The index's objects on disk, the chunk files and the node's counters (published with
        its next heartbeat) agree: no demotion is under way (each writes its file before its swap
        in the index)."""
        on_disk, files = disk_replicas()
        tiers = client.stat().nodes[0].tiers
        return len(on_disk) == len(files) == tiers[0].demotions == tiers[1].objects

    assert wait_until(settled, 10), (disk_replicas(), client.stat().nodes[0])
    on_disk = disk_replicas()[0]
    # No object was evicted (the disk has room for all of them), and at most 14 stay in the host tier.
    assert len(on_disk) >= len(kv) - int(high // MiB), (on_disk, client.stat().nodes[0])
    disk = client.stat().nodes[0].tiers[1]
    assert disk.compression_ratio > 1.0  # float16 KV-like data compresses with byte-plane shuffling
    # Every object reads back byte-exact, from whichever tier holds it (disk reads go through the agent).
    for key, value in kv.items():
        got = client.get(key)
        assert got.dtype == np.float16 and np.array_equal(got, value), key
    # Reading a demoted object brought it back to host memory while there was room.
    first = on_disk[0]
    client.remove_many([k for k in kv if k not in on_disk[:3]])
    removed = time.monotonic()
    # Leases run out, graveyards are freed and a heartbeat publishes it: room again in the host tier.
    assert wait_until(lambda: host_use_since(client, removed) <= 8 * MiB, 10), client.stat().nodes[0]
    # No promotion takes room a writer may still wait for: not within WRITER_WAITS_S of a
    # reservation that did not fit (PressureManager.writer_may_wait), as the puts above did while
    # the drains made room (the reads above may come within it, and then promote nothing).
    time.sleep(max(0.0, puts_done + WRITER_WAITS_S - time.monotonic()))
    client.get(first)
    assert wait_until(lambda: replica_nodes(client, first)[0][1] == "host", 5)
    assert wait_until(lambda: client.stat().nodes[0].tiers[1].promotions >= 1, 5)
    # Removing the rest deletes their files.
    client.remove_many(on_disk[:3])
    assert wait_until(lambda: not list((tmp_path / agent.node_id).rglob("*.mcz")), 5)
    assert not settled_audit(client.index)


def test_corrupted_disk_file_is_an_error_not_wrong_data(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    cluster = make_cluster(0)
    agent = cluster.add_agent(
        node_id="agent-0",
        extra_args=["--host-bytes", str(8 * MiB), "--disk", str(tmp_path), "--disk-mem", str(64 * MiB)],
    )
    client = make_client(cluster, lease_ms=300, timeout_s=5)
    for i in range(16):
        client.put(f"c/{i}", value_for(f"c/{i}"))
    assert wait_until(lambda: bool(list((tmp_path / agent.node_id).rglob("*.mcz"))), 10)
    victim = next(k for k in (f"c/{i}" for i in range(16)) if replica_nodes(client, k)[0][1] == "disk")
    meta = client.object_meta(victim)
    assert meta is not None
    path = next((tmp_path / agent.node_id).rglob(f"{meta.replicas[0].alloc_id:016x}.mcz"))
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x5A
    path.write_bytes(bytes(blob))
    # The agent finds the damage (never wrong data) and drops that replica from the index: the
    # read finds no object, a miss. It used to answer "no longer holds allocation" on every read
    # while the index listed the replica for good.
    with pytest.raises(KeyNotFound):
        client.get(victim)
    assert client.object_meta(victim) is None
    assert int(client.index.redis.hget(client.index.prefix + "stats", "corrupt") or 0) == 1
    assert wait_until(lambda: not path.exists(), 10), "the damaged file stayed after its replica went"
    for i in range(16):  # the others are untouched
        key = f"c/{i}"
        if key != victim:
            assert np.array_equal(client.get(key), value_for(key))


def test_full_cluster_evicts_cold_chain_tails_never_pins(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, host_bytes=16 * MiB)
    client = make_client(cluster, lease_ms=200, timeout_s=20)
    chains = {c: [f"chain{c}/{i:02d}" for i in range(12)] for c in range(4)}  # 48 MiB into 32 MiB
    pin_key = chains[0][5]
    for c, chunk_keys in chains.items():
        client.put_many(
            {k: value_for(k) for k in chunk_keys},
            chain_pos={k: i for i, k in enumerate(chunk_keys)},
            chain_parent={k: chunk_keys[i - 1] for i, k in enumerate(chunk_keys) if i > 0},
        )
        if c == 0:
            pin(client, pin_key)
        time.sleep(0.3)  # chains get distinct ages: chain0 is the coldest
    assert wait_until(lambda: client.stat().evictions > 0, 10)
    time.sleep(1.0)
    present = {c: [client.exists(k) for k in keys] for c, keys in chains.items()}
    assert client.exists(pin_key)
    # Every chain is still prefix-closed (a run of stored chunks from the first), though its chunks
    # were spread over both agents, and the pinned chunk kept its whole prefix alive.
    for c, flags in present.items():
        assert flags == sorted(flags, reverse=True), (c, flags)
    assert all(present[0][:6])
    assert sum(present[3]) >= sum(present[0]) - 1  # the newest chain lost the least
    assert client.stat().evictions == sum(not f for flags in present.values() for f in flags)
    for c, keys in chains.items():
        for k, ok in zip(keys, present[c], strict=True):
            if ok:
                assert np.array_equal(client.get(k), value_for(k))
    assert not settled_audit(client.index)


def redis_exists(client: Client, suffix: str) -> bool:
    return bool(client.index.redis.exists(client.index.prefix + suffix))


def test_move_replicas_swaps_each_entry_on_its_own(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    from mooncake_store.types import Replica, ReplicaState, TierKind

    cluster = make_cluster(1, host_bytes=16 * MiB)
    client = make_client(cluster)
    node = cluster.agents[0].node_id
    for key in ("m/ok", "m/pinned", "m/gone"):
        client.put(key, value_for(key))
    old = {key: client.object_meta(key) for key in ("m/ok", "m/pinned", "m/gone")}
    pin(client, "m/pinned")
    client.remove("m/gone")

    # A registered node that no agent serves: the swap needs its target in the node table.
    from mooncake_store.index.schema import encode_node

    client.index.redis.hset(client.index.prefix + "nodes", "elsewhere", encode_node(node_row("elsewhere"), "ghost"))
    # ... and live: a move onto a node past its heartbeat deadline is refused (EXPIRED).
    client.index.redis.zadd(client.index.prefix + "hb", {"elsewhere": client.index.server_time_ms() + 600_000})

    def new_at(alloc_id: int) -> Replica:
        return Replica(
            node_id="elsewhere",
            tier=TierKind.HOST,
            offset=4096,
            size_bytes=MiB,
            alloc_id=alloc_id,
            state=ReplicaState.COMPLETE,
        )

    moves = [(key, meta.replicas[0].alloc_id, new_at(7 + i), "") for i, (key, meta) in enumerate(old.items()) if meta]
    moves.append(("m/ok", 12345, new_at(99), ""))  # a stale old location: the object no longer holds it
    statuses = client.index.move_replicas(moves, old_node=node)
    assert statuses == ["OK", "PINNED", "GONE", "GONE"]
    redis, prefix = client.index.redis, client.index.prefix
    # The moved object names only the new location (a node that does not exist: read the record).
    assert json.loads(redis.hget(prefix + "o:m/ok", "replicas")) == [["elsewhere", "host", 4096, MiB, "7", "COMPLETE"]]
    assert replica_nodes(client, "m/pinned") == [(node, "host")]
    assert redis.lrange(prefix + "acks:elsewhere", 0, -1) == ["7"]
    assert redis.sismember(prefix + "nobj:elsewhere", "m/ok")
    assert not redis.sismember(prefix + f"nobj:{node}", "m/ok")
    # A retry of a call whose reply was lost answers as the first call did.
    assert client.index.move_replicas(moves[:1], old_node=node) == ["OK"]
    assert redis.lrange(prefix + "acks:elsewhere", 0, -1) == ["7"]
    # A guarded move whose guard is gone (the target reclaimed its reservation) is refused.
    client.put("m/late", value_for("m/late"))
    late = client.object_meta("m/late")
    assert late is not None
    guarded = [("m/late", late.replicas[0].alloc_id, new_at(55), "no-such-guard")]
    assert client.index.move_replicas(guarded, old_node=node) == ["EXPIRED"]
    client.index.guard_reservations(["live-guard"], node_id="elsewhere", ttl_ms=60_000)
    guarded = [("m/late", late.replicas[0].alloc_id, new_at(56), "live-guard")]
    assert client.index.move_replicas(guarded, old_node=node) == ["OK"]
    assert not redis_exists(client, "pend:live-guard")  # the swap took the guard


@SPILL_PATHS
def test_batched_spill_moves_a_burst_keeps_pinned_and_leased(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], spill_args: list[str]
) -> None:
    """A full agent released at once spills most of itself to its peer in a few batches: everything
    byte-exact, nothing evicted, pinned and leased (hot) objects stay, counters agree."""
    cluster = make_cluster(0)
    cluster.add_agent(
        node_id="agent-0",
        extra_args=["--host-bytes", str(48 * MiB), "--high-watermark", "0.5", "--low-watermark", "0.1", *spill_args],
    )
    cluster.add_agent(node_id="agent-1", extra_args=["--host-bytes", str(160 * MiB)])
    client = make_client(cluster, lease_ms=300, timeout_s=20)
    hot_reader = make_client(cluster, lease_ms=120_000)
    keys = [f"burst/{i:02d}" for i in range(40)]  # 40 MiB of 48: far past the high watermark
    for key in keys:
        pin(client, key)  # before the put: nothing can move while the agent fills
    for key in keys:
        client.put(key, value_for(key), preferred_node="agent-0")
    assert all(replica_nodes(client, k) == [("agent-0", "host")] for k in keys)
    hot_reader.get(keys[-1])  # a live read lease: not a victim
    prefix = client.index.prefix
    client.index.redis.delete(*(prefix + "pins:" + k for k in keys[1:]))  # keys[0] stays pinned
    client.put("burst/trigger", b"x", preferred_node="agent-0")  # a reservation wakes the pressure loop

    def on_agent_1() -> int:
        return sum(replica_nodes(client, k)[0][0] == "agent-1" for k in keys)

    assert wait_until(lambda: on_agent_1() >= 30, 15), on_agent_1()
    time.sleep(0.5)
    assert replica_nodes(client, keys[0]) == [("agent-0", "host")]
    assert replica_nodes(client, keys[-1]) == [("agent-0", "host")]
    for key in keys:
        assert np.array_equal(client.get(key), value_for(key)), key
    moved = on_agent_1()
    stats = {n.node_id: n.tiers[0] for n in client.stat().nodes}
    assert wait_until(
        lambda: (
            (s := {n.node_id: n.tiers[0] for n in client.stat().nodes})["agent-0"].spills_out == moved
            and s["agent-1"].spills_in == moved
        ),
        5,
    ), stats
    assert client.stat().evictions == 0


def test_a_drain_goes_on_down_to_the_low_watermark_across_passes(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """One pass samples a bounded number of objects (256); with small objects that is far less than
    a drain from the high watermark to the low one. The drain must go on, pass after pass, below
    the high watermark, until the tier is under its low one."""
    cluster = make_cluster(0)
    arena = 48 * MiB
    cluster.add_agent(
        node_id="agent-0",
        extra_args=["--host-bytes", str(arena), "--high-watermark", "0.8", "--low-watermark", "0.1"],
    )
    cluster.add_agent(node_id="agent-1", extra_args=["--host-bytes", str(160 * MiB)])
    client = make_client(cluster, lease_ms=200, timeout_s=20)
    size = 32 << 10
    keys = [f"small/{i:04d}" for i in range(int(0.9 * arena) // size)]  # ~1380 objects, 3x one sample
    values = {k: np.full(size, i % 251, dtype=np.uint8) for i, k in enumerate(keys)}
    now_ms = client.index.server_time_ms()
    pipe = client.index.redis.pipeline(transaction=False)
    for key in keys:  # pinned before the puts: nothing moves while agent-0 fills
        pipe.zadd(client.index.prefix + "pins:" + key, {"test-pin": now_ms + 120_000})
    pipe.execute()
    for start in range(0, len(keys), 128):
        batch = keys[start : start + 128]
        client.put_many({k: values[k] for k in batch}, preferred_node="agent-0")
    client.index.redis.delete(*(client.index.prefix + "pins:" + k for k in keys))

    def objects_on(node_id: str) -> int:  # the index's set of a node's objects: one SCARD
        return int(client.index.redis.scard(client.index.prefix + "nobj:" + node_id))

    # The released agent is past its high watermark; its drain ends under the low one (10 %).
    at_most_left = int(0.1 * arena) // size
    assert wait_until(lambda: objects_on("agent-0") <= at_most_left, 20), objects_on("agent-0")
    placed = [replica_nodes(client, k)[0][0] for k in keys]
    assert placed.count("agent-0") <= at_most_left and placed.count("agent-1") == len(keys) - placed.count("agent-0")
    for key in keys[:: max(1, len(keys) // 64)]:
        assert np.array_equal(client.get(key), values[key]), key
