"""A spill batch moves under one guard, and its swap writes the index once per set and list
(agent/spill.py, move_replicas.lua); the pressure pass's scripts are loaded when the agent starts;
victims.lua reads without writing. Real agents in this process (their syncs run when a test calls
them), a real server, real reservations and WRITEs over TCP."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
import redis
from helpers import host_replica, random_bytes

from mooncake_store import Client, LocalCluster, MooncakeError
from mooncake_store.agent.node import Agent
from mooncake_store.index.client import RedisIndex
from mooncake_store.index.schema import encode_replica
from mooncake_store.transport.frames import SPILL_FLAG
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import Replica, TierKind

KiB = 1 << 10
SIZE = 64 * KiB
KEYS = ("b/0", "b/1", "b/2")


def copy_batch(client: Client, a: Agent, b: Agent) -> tuple[list[tuple[str, int, Replica, str]], str]:
    """Put KEYS on ``a``, then copy them to ``b`` as a's spiller does one batch: one guard for the
    batch, one RESERVE of every entry under its put id, the WRITEs. Returns the batch's moves for
    move_replicas (each naming the shared guard) and the guard."""
    put_id = uuid.uuid4().bytes
    guard = put_id.hex()
    for i, key in enumerate(KEYS):
        client.put(key, random_bytes(SIZE, i), preferred_node=a.node_id)
    client.index.guard_reservations([guard], node_id=b.node_id, ttl_ms=60_000)
    tcp = TcpTransport(timeout_s=10.0, connections_per_peer=1, stripe_bytes=1 << 30)
    moves = []
    try:
        peer = tcp.peer(b.server.endpoint)
        reservations = peer.reserve([(SIZE, put_id)] * len(KEYS), node_id=b.node_id, flags=SPILL_FLAG)
        for i, (key, res) in enumerate(zip(KEYS, reservations, strict=True)):
            peer.write(res.alloc_id, res.offset, memoryview(random_bytes(SIZE, i)))
            meta = client.object_meta(key)
            assert meta is not None and meta.replicas[0].node_id == a.node_id
            moves.append((key, meta.replicas[0].alloc_id, host_replica(b.node_id, res, SIZE), guard))
    finally:
        tcp.close()
    return moves, guard


def test_a_batch_under_one_guard_swaps_whole_and_its_peer_commits_every_entry(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    a, b = direct_agent(namespace), direct_agent(namespace)
    client = client_of(namespace)
    moves, guard = copy_batch(client, a, b)
    rds, prefix = client.index.redis, client.index.prefix
    assert client.index.move_replicas(moves, old_node=a.node_id) == ["OK"] * len(KEYS)
    assert not rds.exists(prefix + "pend:" + guard), "the swap did not take the batch's guard"
    # What the swaps wrote once per set and list: every entry, in order.
    assert rds.lrange(prefix + "acks:" + b.node_id, 0, -1) == [str(m[2].alloc_id) for m in moves]
    assert rds.smembers(prefix + "nobj:" + b.node_id) == set(KEYS)
    assert not rds.smembers(prefix + "nobj:" + a.node_id) & set(KEYS)
    assert {int(x) for x in rds.zrange(prefix + "gc:" + a.node_id, 0, -1)} == {m[1] for m in moves}
    b.sync_once()  # the acks commit every reservation of the batch, though they share a put id
    for i, (key, _, new, _) in enumerate(moves):
        assert b.table.offset_of(new.alloc_id) is not None, key
        meta = client.object_meta(key)
        assert meta is not None and [r.node_id for r in meta.replicas] == [b.node_id]
        assert np.array_equal(client.get(key), random_bytes(SIZE, i)), key
    # A retry of the call (its reply lost) answers as the first did.
    assert client.index.move_replicas(moves, old_node=a.node_id) == ["OK"] * len(KEYS)


def test_one_reservation_of_a_batch_timing_out_on_its_peer_refuses_the_whole_batch(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """The peer's sync meets the batch's put id once per expired reservation: the first revokes the
    guard ("R"), the rest find it gone ("G", not acked): all freed. The swap then finds no guard and
    moves nothing; every object stays readable where it was."""
    a, b = direct_agent(namespace), direct_agent(namespace, reserve_timeout_s=0.2)
    client = client_of(namespace)
    moves, guard = copy_batch(client, a, b)
    rds, prefix = client.index.redis, client.index.prefix
    assert len(b.table.reserved_deadlines()) == len(KEYS)
    time.sleep(0.3)  # past the peer's reservation timeout
    b.sync_once()
    assert not rds.exists(prefix + "pend:" + guard), "the peer's sync did not revoke the batch's guard"
    assert all(b.table.offset_of(m[2].alloc_id) is None for m in moves), "the peer kept expired reservations"
    assert client.index.move_replicas(moves, old_node=a.node_id) == ["EXPIRED"] * len(KEYS)
    assert rds.llen(prefix + "acks:" + b.node_id) == 0
    assert not rds.smembers(prefix + "nobj:" + b.node_id)
    assert rds.zcard(prefix + "gc:" + a.node_id) == 0
    for i, key in enumerate(KEYS):
        meta = client.object_meta(key)
        assert meta is not None and [r.node_id for r in meta.replicas] == [a.node_id]
        assert np.array_equal(client.get(key), random_bytes(SIZE, i)), key


def test_victims_count_live_pins_and_chain_children_without_writing(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    a = direct_agent(namespace)
    client = client_of(namespace)
    client.put_many(
        {"c/0": random_bytes(SIZE, 0), "c/1": random_bytes(SIZE, 1), "c/1b": random_bytes(SIZE, 2)},
        chain_pos={"c/0": 0, "c/1": 1, "c/1b": 1},
        chain_parent={"c/1": "c/0", "c/1b": "c/0"},
        preferred_node=a.node_id,
    )
    client.put("loose", random_bytes(SIZE, 3), preferred_node=a.node_id)
    rds, prefix = client.index.redis, client.index.prefix
    now = client.index.server_time_ms()
    rds.zadd(prefix + "pins:c/1", {"live": now + 60_000, "lapsed": now - 1_000})
    rds.zadd(prefix + "pins:loose", {"lapsed": now - 1_000})
    got = {c.key: c for c in a.index.victim_candidates(a.node_id, "host", sample=64)}
    assert set(got) == {"c/0", "c/1", "c/1b", "loose"}
    assert (got["c/0"].children, got["c/1"].children, got["loose"].children) == (2, 0, 0)
    assert (got["c/1"].pins, got["loose"].pins, got["c/0"].pins) == (1, 0, 0)
    assert got["c/1"].chain_parent == "c/0" and got["c/0"].chain_parent == ""
    # Read only: the lapsed pins are still there (other scripts drop them as they meet them).
    assert rds.zcard(prefix + "pins:loose") == 1 and rds.zcard(prefix + "pins:c/1") == 2


def test_the_preludes_chunked_returns_every_reply_across_its_runs(
    client_of: Callable[[str], Client], namespace: str
) -> None:
    """victims.lua reads its chain counts with the prelude's ``chunked`` (one HMGET per 1000 fields,
    unpack's stack limit): its replies come back joined, in order, missing fields as nil, across
    the runs (2500 fields: three HMGETs)."""
    from mooncake_store.index.scripts import _read, build_script

    client = client_of(namespace)
    rds, prefix = client.index.redis, client.index.prefix
    key = prefix + "chunked-test"
    rds.hset(key, mapping={f"f{i}": str(i) for i in range(1, 2501) if i % 3})  # every third missing
    body = """local items = {}
for i = 1, tonumber(ARGV[3]) do items[i] = 'f' .. i end
return chunked('HMGET', ARGV[2], items)"""
    try:
        got = build_script(rds, _read("prelude"), body)(args=[prefix, key, 2500])
    finally:
        rds.delete(key)
    assert got == [None if i % 3 == 0 else str(i) for i in range(1, 2501)]


def test_an_agent_loads_its_pressure_scripts_when_it_starts() -> None:
    """On a server of its own (no script loaded yet): once the agent is up, the scripts of a pressure
    pass are there before any pass has run, so a first spill does not wait for their compilation."""
    with LocalCluster(num_agents=0) as cluster:
        index = RedisIndex(cluster.redis_url, namespace=cluster.namespace)
        try:
            names = ("victims", "move_replicas", "evict")
            shas = [index._scripts[n].sha for n in names]
            assert index.redis.script_exists(*shas) == [False] * len(names)
            cluster.add_agent(node_id="fresh")
            assert index.redis.script_exists(*shas) == [True] * len(names)
        finally:
            index.close()


def test_connections_sharing_one_source_of_writes_make_each_write_once(
    direct_agent: Callable[..., Agent], namespace: str
) -> None:
    """PeerConnections.write_pulled on two connections at once, pulling from one source: every
    write goes out exactly once, on one connection or the other, its ack comes back under its tag,
    and parts of one reservation written by different connections land where they belong."""
    b = direct_agent(namespace, host_bytes=16 << 20)
    count, part = 12, 64 * KiB
    data = random_bytes(count * 2 * part, 7)
    tcp = TcpTransport(timeout_s=10.0, connections_per_peer=2, stripe_bytes=1 << 30)
    try:
        peer = tcp.peer(b.server.endpoint)
        reservations = peer.reserve([(2 * part, uuid.uuid4().bytes)] * count, node_id=b.node_id)
        # Each reservation in two halves, as the spiller cuts a large object into pieces.
        writes = [
            (2 * i + h, r.alloc_id, r.offset + h * part, memoryview(data)[(2 * i + h) * part : (2 * i + h + 1) * part])
            for i, r in enumerate(reservations)
            for h in (0, 1)
        ]
        source = iter(writes)
        lock = threading.Lock()

        def take(_wait: bool) -> tuple[int, int, int, memoryview] | None:
            with lock:
                return next(source, None)

        got: list[list[tuple[int, bool]]] = [[], []]
        told: list[list[tuple[int, bool]]] = [[], []]

        def stream(k: int) -> None:
            got[k].extend(peer.write_pulled(take, window=3, acked=lambda tag, ok: told[k].append((tag, ok))))

        threads = [threading.Thread(target=stream, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        tags = sorted(tag for per in got for tag, _ in per)
        assert tags == list(range(2 * count)), got
        assert told == got, "each ack is told as it comes, in the order returned"
        assert all(ok for per in got for _, ok in per)
        for i, r in enumerate(reservations):
            assert bytes(b.arena.view(r.offset, 2 * part)) == data[2 * i * part : 2 * (i + 1) * part].tobytes(), i
    finally:
        tcp.close()


def test_objects_larger_than_a_piece_spill_over_tcp_byte_exact(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """Host-tier objects above PIECE_BYTES go to the peer in pieces that the streams share out: each
    lands whole (every piece, in its place), is swapped, and reads back byte-exact from the peer."""
    from mooncake_store.agent.pressure import MAX_PASSES
    from mooncake_store.agent.spill import PIECE_BYTES

    size = 2 * PIECE_BYTES + 12345  # three pieces, the last one short
    # Five objects take 5/5.4 of A's arena: past its high watermark (0.9); the low one (0.75) is 4.05.
    a = direct_agent(namespace, host_bytes=int(5.4 * size), spill_to_peers=True, spill_shm=False)
    b = direct_agent(namespace, host_bytes=8 * size)
    client = client_of(namespace)
    values = {f"big/{i}": random_bytes(size, 100 + i) for i in range(5)}
    for key, value in values.items():
        client.put(key, value, preferred_node=a.node_id)
        time.sleep(0.002)  # each colder than the next
    a.sync_once()
    for _ in range(MAX_PASSES):
        if a.pressure.relieve_host() == 0:
            break
    b.sync_once()
    moved = [k for k in values if [r.node_id for r in client.object_meta(k).replicas] == [b.node_id]]  # type: ignore[union-attr]
    assert moved, "nothing was spilled: the case did not exercise the pieces"
    for key in moved:
        assert np.array_equal(client.get(key), values[key]), key
    assert int(a.pressure.counters[TierKind.HOST]["spills_out"]) == len(moved)


def test_a_large_object_whose_reservation_went_stays_put_and_is_logged_once(
    direct_agent: Callable[..., Agent],
    client_of: Callable[[str], Client],
    namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A host object of three pieces whose reservation timed out on the peer before its WRITEs: every
    piece comes back refused, the object is not swapped and stays on its node byte-exact, and the
    spiller says "reservation gone" once for it, not once per piece (it said so three times). It
    comes back unsent, with the peer refused for the pass (a WRITE the peer refused: placed
    elsewhere, else evicted; test_disk_peer_write_failures.py)."""
    from mooncake_store.agent.spill import PIECE_BYTES, Spiller, SpillJob

    size = 2 * PIECE_BYTES + 12345  # three pieces
    a = direct_agent(namespace, host_bytes=4 * size, spill_to_peers=True, spill_shm=False)
    b = direct_agent(namespace, host_bytes=4 * size)
    client = client_of(namespace)
    value = random_bytes(size, 7)
    client.put("gone/0", value, preferred_node=a.node_id)
    (victim,) = [c for c in a.index.victim_candidates(a.node_id, "host") if c.key == "gone/0"]
    location = a.table.offset_of(victim.alloc_id)
    assert location is not None
    spiller = Spiller(a)
    real_views = spiller._views

    def after_the_reservation_timed_out(*args):  # type: ignore[no-untyped-def]
        reserved, _tier, _source = args  # the batch reserved, just before its WRITEs are queued
        assert b.table.expire_now([r.alloc_id for r in reserved.reservations]) == 1
        b.sync_once()  # B frees it (no commit in the index), as its sync does once it times out
        return real_views(*args)

    spiller._views = after_the_reservation_timed_out  # type: ignore[method-assign]
    try:
        with caplog.at_level("INFO", logger="mooncake.agent"):
            result = spiller.spill(a.index.nodes()[b.node_id], [SpillJob(victim=victim, offset=location[0])])
    finally:
        spiller.close()
    assert not result.moved and result.refused and result.error is None
    assert [job.victim.key for job in result.unsent] == ["gone/0"], result
    gone = [r.getMessage() for r in caplog.records if "reservation gone" in r.getMessage()]
    assert gone == [f"spill of gone/0 to {b.server.endpoint}: reservation gone"], gone
    assert [r.node_id for r in client.object_meta("gone/0").replicas] == [a.node_id]  # type: ignore[union-attr]
    assert np.array_equal(client.get("gone/0"), value)


def test_move_replicas_refuses_a_guard_shared_by_more_moves_than_one_call_takes(
    client_of: Callable[[str], Client], namespace: str
) -> None:
    """One call of move_replicas.lua takes BATCH_LIMIT moves and deletes the guards it used: 4097
    moves under one guard were cut into two calls, the first deleting the guard and the 4097th
    coming back EXPIRED. Now they are refused (InvalidValue, with the count and the limit) before
    anything is sent: the guard is still there."""
    from mooncake_store.errors import InvalidValue
    from mooncake_store.index.schema import BATCH_LIMIT

    client = client_of(namespace)
    guard = uuid.uuid4().hex
    client.index.guard_reservations([guard], node_id="nowhere", ttl_ms=60_000)
    new = Replica(node_id="nowhere", tier=TierKind.HOST, offset=0, size_bytes=1, alloc_id=1)
    moves = [(f"absent/{i}", i, new, guard) for i in range(BATCH_LIMIT + 1)]
    with pytest.raises(InvalidValue, match=rf"{BATCH_LIMIT + 1} moves share the guard .* at most {BATCH_LIMIT}"):
        client.index.move_replicas(moves, old_node="nobody")
    assert client.index.redis.get(client.index.prefix + "pend:" + guard) == "guard:nowhere"


def test_the_index_remembers_which_swaps_landed_for_a_mover_that_lost_the_reply(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """A swap that lands leaves "<node>:<alloc>" in landed:<mover>, with the batch and with a single
    move_replica alike; a refused one leaves nothing; the record outlives the object (removed and
    its grave gone), which is what LocalMoves._keep asks once the index is back."""
    a, b = direct_agent(namespace), direct_agent(namespace)
    client = client_of(namespace)
    moves, _ = copy_batch(client, a, b)
    refused = (moves[2][0], 999_999, moves[2][2], moves[2][3])  # an old location the object never had
    statuses = client.index.move_replicas([moves[0], moves[1], refused], old_node=a.node_id)
    assert statuses == ["OK", "OK", "GONE"]
    targets = [(m[2].node_id, m[2].alloc_id) for m in moves]
    assert client.index.landed(a.node_id, targets) == set(targets[:2])
    # One object alone, as a demotion's swap goes (move_replica.lua).
    meta = client.object_meta(KEYS[2])
    assert meta is not None
    status = client.index.move_replica(
        KEYS[2], old_node=a.node_id, old_alloc_id=meta.replicas[0].alloc_id, new=moves[2][2]
    )
    assert status == "OK"
    assert client.index.landed(a.node_id, targets) == set(targets)
    assert client.index.landed(b.node_id, targets) == set()  # recorded under the mover only
    # Removed, and the peer's graves drained: the record of the swap is what is left.
    assert client.remove_many(list(KEYS)) == [True] * len(KEYS)
    b.sync_once()
    b.sync_once()
    assert not client.index.buried(b.node_id, [t[1] for t in targets])
    assert client.index.landed(a.node_id, targets) == set(targets)
    ttl = client.index.redis.pttl(client.index.prefix + "landed:" + a.node_id)
    assert 0 < ttl <= 120_000, ttl


def test_a_batch_with_a_malformed_entry_writes_nothing(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """Every entry of a move_replicas call is checked before anything is written: when a later one
    meets an error (a location that is not JSON, a record whose lease is not a number), the call
    fails and the entries before it have not moved either. Half a batch swapped without its acks,
    graves and guard would name memory the peer then frees."""
    a, b = direct_agent(namespace), direct_agent(namespace)
    client = client_of(namespace)
    moves, guard = copy_batch(client, a, b)
    rds, prefix = client.index.redis, client.index.prefix
    before = {key: rds.hgetall(prefix + "o:" + key) for key in KEYS}

    def unchanged() -> None:
        assert {key: rds.hgetall(prefix + "o:" + key) for key in KEYS} == before
        assert rds.exists(prefix + "pend:" + guard), "the guard went with a call that failed"
        assert rds.llen(prefix + "acks:" + b.node_id) == 0
        assert rds.zcard(prefix + "gc:" + a.node_id) == 0
        assert rds.smembers(prefix + "nobj:" + a.node_id) >= set(KEYS)
        assert not rds.exists(prefix + "landed:" + a.node_id)

    script = client.index._scripts["move_replicas"]
    args = [prefix, a.node_id]
    for key, old_alloc, new, g in moves[:2]:
        args += [key, str(old_alloc), json.dumps(encode_replica(new)), g]
    args += [moves[2][0], str(moves[2][1]), "{not json", guard]
    with pytest.raises(redis.ResponseError):
        script(keys=[], args=args)
    unchanged()
    rds.hset(prefix + "o:" + KEYS[2], "lease_until", "soon")
    before[KEYS[2]]["lease_until"] = "soon"
    with pytest.raises(MooncakeError):
        client.index.move_replicas(moves, old_node=a.node_id)
    unchanged()
    for i, key in enumerate(KEYS[:2]):
        assert np.array_equal(client.get(key), random_bytes(SIZE, i)), key
