"""Review of the index's Lua scripts (session 5): each test fails on the code as reviewed, for the
reason its docstring gives. Real Redis (the session's embedded server), the real RedisIndex; some
tests call a script with arguments the SDK would not send, which is what a buggy or hostile client
of the same namespace can do."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import node_row, pending_put
from index_audit import audit_index

from mooncake_store.client.put_plans import MAX_CHAIN_POS
from mooncake_store.errors import MooncakeError
from mooncake_store.index.client import PendingPut, RedisIndex
from mooncake_store.index.prefix import MAX_CHAIN_CHUNKS, PrefixIndex
from mooncake_store.index.schema import BATCH_LIMIT
from mooncake_store.types import NodeInfo, Replica, TierKind, TierUsage

TTL_MS = 600_000


@pytest.fixture
def index(redis_url: str) -> Iterator[RedisIndex]:
    idx = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}", timeout_s=60.0)
    try:
        yield idx
    finally:
        idx.close()


def _node_info(node_id: str, *, tiers: tuple[TierUsage, ...] | None = None) -> NodeInfo:
    return node_row(node_id, tiers=tiers or (TierUsage(tier=TierKind.HOST, capacity_bytes=1 << 30, used_bytes=0),))


def _register(index: RedisIndex, node_id: str, **kw: Any) -> None:
    index.register_node(_node_info(node_id, **kw), incarnation=f"inc-{node_id}", ttl_ms=TTL_MS)


def _pending(key: str, node: str, alloc: int, **kw: Any) -> PendingPut:
    return dataclasses.replace(pending_put(key, (node, TierKind.HOST, alloc)), **kw)


def _commit(index: RedisIndex, put: PendingPut) -> str:
    index.put_start([put], ttl_ms=TTL_MS)
    (status,) = index.put_commit([put.put_id])
    return str(status)


# ---- 1. put_commit writes half an object, then fails ------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"dtype": None}, id="dtype-missing"),
        pytest.param({"chain_pos": True}, id="chain_pos-bool"),
        pytest.param({"chain_parent": {"a": 1}}, id="chain_parent-object"),
    ],
)
def test_put_commit_of_a_malformed_pending_entry_leaves_no_half_written_object(
    index: RedisIndex, bad: dict[str, Any]
) -> None:
    """put_start.lua stores whatever entry a client sends, and put_commit.lua:35-66 only finds a bad
    field when a redis.call refuses it (a nil or a boolean/table argument), after it has already
    buried the old object's replicas (gc:<node> + SREM nobj), pushed the new alloc to the agent's
    ack list and bumped the version. Redis keeps those writes: with a missing dtype the record still
    names v1's alloc, which now sits in its agent's graveyard (freed once the lease is over: readers
    then read freed memory) while nobj:A no longer lists the key (a reap of A would miss it) and B
    is acked an alloc nothing names; with a bad chain_pos/chain_parent the object is replaced but its
    pending record, parent count and keys entry are not, so the writer's revoke and the agent's
    reclaim free the bytes of a visible object."""
    _register(index, "A")
    _register(index, "B")
    key = f"k-{uuid.uuid4().hex[:8]}"
    assert _commit(index, _pending(key, "A", 1)) == "OK"
    entry = {
        "put_id": uuid.uuid4().hex,
        "key": key,
        "size": 16,
        "dtype": "|u1",
        "shape": "16",
        "checksum": "7",
        "replicas": [["B", "host", 0, 16, "2", "PENDING"]],
    }
    for field, value in bad.items():
        if value is None:
            del entry[field]
        else:
            entry[field] = value
    errors: list[str] = []
    try:
        index._run("put_start", TTL_MS, json.dumps([entry]))
        index.put_commit([entry["put_id"]])
    except MooncakeError as exc:
        errors.append(str(exc))
    problems = audit_index(index)
    assert not problems, f"after {errors or 'no error'}: index left inconsistent: {problems}"


def test_put_commit_stores_the_checksums_it_carries_and_refuses_a_malformed_one_whole(index: RedisIndex) -> None:
    """The SDK commits the checksum of the bytes as they landed (taken after put_start), which
    replaces the pending entry's; a u64 keeps every digit (never a Lua number). A malformed one in a
    batch commits nothing of the batch; an id without one keeps the pending entry's checksum."""
    _register(index, "A")
    keys = [f"k-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    puts = [_pending(key, "A", 10 + i) for i, key in enumerate(keys)]
    index.put_start(puts, ttl_ms=TTL_MS)
    bad = [f"{puts[0].put_id}={2**64 - 1}", f"{puts[1].put_id}=12x"]
    with pytest.raises(MooncakeError, match="malformed checksum"):
        index._run("put_commit", *bad)
    assert index.lookup(keys, lease_ms=0).objects == [None, None, None], "a refused batch committed a put"
    assert index.put_commit([p.put_id for p in puts[:2]], checksums=[2**64 - 1, 0]) == ["OK", "OK"]
    assert index.put_commit([puts[2].put_id]) == ["OK"]
    metas = index.lookup(keys, lease_ms=0).objects
    assert [m.checksum if m else None for m in metas] == [2**64 - 1, 0, 7]
    assert not audit_index(index)


# ---- 2. numbers above 14 significant digits ---------------------------------------------------


@pytest.mark.parametrize("pos", [12_345_678_901_234, MAX_CHAIN_POS])
def test_chain_pos_the_sdk_accepts_survives_the_index(index: RedisIndex, pos: int) -> None:
    """puts.py accepted chain_pos up to 2**53 - 1, but put_start.lua keeps the entry as
    cjson.encode(cjson.decode(entry)), and Lua's cjson prints numbers with 14 significant digits:
    2**53 - 1 was stored as 9007199254741000, and the eviction policy ranked the chunk by a position
    it was never given. The SDK's limit is now 10**14 - 1, and put_start refuses anything larger."""
    _register(index, "A")
    key = f"k-{uuid.uuid4().hex[:8]}"
    assert _commit(index, _pending(key, "A", 1, chain_pos=pos)) == "OK"
    (cand,) = index.victim_candidates("A", "host")
    assert cand.chain_pos == pos
    with pytest.raises(MooncakeError, match="BAD_ENTRY"):
        _commit(index, _pending(f"{key}-big", "A", 1, chain_pos=10**14))


def test_node_table_numbers_survive_register_and_heartbeat(index: RedisIndex) -> None:
    """node_register.lua:24-30 and node_heartbeat.lua:12-16 decode the node JSON and write it back
    with cjson.encode (14 significant digits): a disk tier's capacity or use of 123456789012345 B
    (112 TiB) reads back from nodes() as 123456789012340, and counters past 1e14 likewise. The
    record should keep the agent's integers exactly (splice the JSON as a string, or keep tiers in
    a field of their own)."""
    big = 123_456_789_012_345
    tiers = (TierUsage(tier=TierKind.DISK, capacity_bytes=big, used_bytes=big - 2, counters={"raw_bytes": big + 4}),)
    _register(index, "A", tiers=tiers)
    got = index.nodes()["A"].tier(TierKind.DISK)
    assert got is not None
    registered = (got.capacity_bytes, got.used_bytes, got.counters.get("raw_bytes"))
    assert index.heartbeat("A", incarnation="inc-A", ttl_ms=TTL_MS, tiers=tiers)
    got = index.nodes()["A"].tier(TierKind.DISK)
    assert got is not None
    beaten = (got.capacity_bytes, got.used_bytes, got.counters.get("raw_bytes"))
    assert (registered, beaten) == ((big, big - 2, big + 4),) * 2


# ---- 3. records no reader can read ------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"checksum": "not-a-number"}, id="checksum"),
        pytest.param({"size": 1.5}, id="size-fractional"),
        pytest.param({"shape": "a,b"}, id="shape"),
    ],
)
def test_a_committed_record_never_breaks_its_readers_with_a_raw_error(index: RedisIndex, bad: dict[str, Any]) -> None:
    """put_start.lua/put_commit.lua check no field of an entry, so a record with checksum
    "not-a-number", size 1.5 or shape "a,b" commits OK, and from then on every RedisIndex.lookup
    of the key (any get, by any client) dies with a bare ValueError from schema.decode_object:
    neither a MooncakeError (DESIGN §3.6) nor a miss. The scripts should refuse such an entry
    (or decode_object turn it into ProtocolError)."""
    _register(index, "A")
    key = f"k-{uuid.uuid4().hex[:8]}"
    entry = {
        "put_id": uuid.uuid4().hex,
        "key": key,
        "size": 16,
        "dtype": "|u1",
        "shape": "16",
        "checksum": "7",
        "replicas": [["A", "host", 0, 16, "1", "PENDING"]],
        **bad,
    }
    try:
        index._run("put_start", TTL_MS, json.dumps([entry]))
        index.put_commit([entry["put_id"]])
        index.lookup([key], lease_ms=1000)
    except MooncakeError:
        pass  # refused, or reported as a malformed record: both fine
    except Exception as exc:
        pytest.fail(f"lookup of a record committed from {bad} raised {type(exc).__name__}: {exc}")


def test_a_moved_replica_with_an_unknown_tier_does_not_break_lookups_of_other_keys(index: RedisIndex) -> None:
    """swap_replica (prelude.lua:130-165) stores the new location exactly as the caller sent it.
    A replica with tier "nvme" (a newer or buggy agent) makes lookup.lua:36 compare nil with a
    number (TIER_RANK has no "nvme") for every object with two live replicas: the whole lookup
    script fails, so every batch that contains the key fails, for every other key in it too
    (after having extended the leases of the keys before it). move_replica should refuse a
    location it cannot judge, or lookup should rank an unknown tier last."""
    _register(index, "A")
    _register(index, "B")
    _register(index, "C")
    key, other = f"k-{uuid.uuid4().hex[:8]}", f"o-{uuid.uuid4().hex[:8]}"
    put = _pending(key, "A", 1)
    put = dataclasses.replace(
        put, replicas=(put.replicas[0], Replica(node_id="B", tier=TierKind.HOST, offset=0, size_bytes=16, alloc_id=2))
    )
    assert _commit(index, put) == "OK"
    assert _commit(index, _pending(other, "A", 3)) == "OK"
    try:
        status = index._run("move_replica", key, "B", "2", json.dumps(["C", "nvme", 0, 16, "4", "COMPLETE"]))
    except MooncakeError:
        status = "refused"
    try:
        found = index.lookup([other, key], lease_ms=1000).objects[0]
    except MooncakeError as exc:
        pytest.fail(f"move_replica answered {status!r}; then a lookup of [{other!r}, {key!r}] failed: {exc}")
    assert found is not None


# ---- 4. one call doing unbounded work ---------------------------------------------------------


def test_agent_sync_with_a_large_grave_budget_keeps_working(index: RedisIndex) -> None:
    """agent_sync.lua:48 removes the due graves with ZREM gk unpack(due), one unpack of up to
    max_graves ids (its own append() splits by 1000 because "unpack has a stack limit"; this one
    does not). RedisIndex.agent_sync(max_graves=10_000) with 10,000 graves due fails with "too
    many results to unpack", after it has already revoked the expired put ids (their "R" statuses
    are lost) and moved the acks, and it fails again on every retry while 8,000 graves are due:
    that agent never frees anything again."""
    index._run("node_register", "A", json.dumps({"incarnation": "i1"}), TTL_MS)
    index.redis.zadd(index.prefix + "gc:A", {str(i): 0 for i in range(1, 10_001)})
    result = index.agent_sync("A", incarnation="i1", expired_put_ids=[], applied_last=True, max_graves=10_000)
    assert len(result.graves) == 10_000


def test_prefix_match_of_the_longest_allowed_chain_is_split_into_bounded_calls(index: RedisIndex) -> None:
    """prefix.py lets one prefix_match call walk MAX_CHAIN_CHUNKS = 65,536 keys ("tens of
    milliseconds"), and with a lease the script pins each of them (ZADD + ZREMRANGEBYSCORE + ZCARD
    + HSET per chunk) in the same call. Measured here: ~0.13 s without pins, ~0.5 s with (the
    server answers nobody meanwhile). Every other batch operation stops at BATCH_LIMIT = 4096 keys
    per script call; a pinned match of the longest chain should too (walk in windows, continue
    while the whole window matched)."""
    _register(index, "A")
    n = MAX_CHAIN_CHUNKS
    keys = [f"c{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
    puts = [_pending(k, "A", i + 1) for i, k in enumerate(keys)]
    index.put_start(puts, ttl_ms=TTL_MS)
    assert set(index.put_commit([p.put_id for p in puts])) == {"OK"}
    prefix = PrefixIndex(index)
    # This match's own script calls: the server's commandstats also count every agent's scripts on
    # the shared server, which a slow match would let make up the number.
    match_calls: list[str] = []
    real_run = prefix._run

    def counting_run(name: str, *args: object) -> object:
        if name == "prefix_match":
            match_calls.append(name)
        return real_run(name, *args)

    prefix._run = counting_run  # type: ignore[method-assign]
    result = prefix.match(keys, pin_id="p1", lease_ms=60_000)
    calls = len(match_calls)
    assert result.num_chunks == n
    assert calls >= math.ceil(n / BATCH_LIMIT), f"{n} chunks matched and pinned in {calls} script call(s)"


# ---- 5. bookkeeping left behind ---------------------------------------------------------------


def test_a_purged_node_leaves_no_hit_counters_behind(index: RedisIndex) -> None:
    """lookup.lua:54-64 counts hits per node and tier in stats as hits:<node>:<tier>; node_register
    clears them for a new incarnation of the same id, but purge_node (prelude.lua:75-104, run by
    node_deregister and node_reap) leaves them. Default node ids are "<host>-<pid>", new at every
    agent start, so the stats hash (read whole by every stats() call) grows by a few fields for
    every agent that ever ran, forever."""
    _register(index, "A")
    key = f"k-{uuid.uuid4().hex[:8]}"
    assert _commit(index, _pending(key, "A", 1)) == "OK"
    assert index.lookup([key], lease_ms=1).objects[0] is not None
    time.sleep(0.01)
    index.deregister_node("A", incarnation="inc-A")
    assert "A" not in index.nodes()
    left = [f for f in index.redis.hkeys(index.prefix + "stats") if f.startswith("hits:A:")]
    assert left == []
