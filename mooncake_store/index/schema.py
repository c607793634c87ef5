"""Key layout and record encoding of the index.

Every key of a namespace shares one hash tag, ``mc:{ns}:``, so that a namespace's keys hash to one
slot. That is a first step toward Redis Cluster, not support for it: the scripts name their keys
through the prefix in ARGV rather than in KEYS, and the client is a plain redis.Redis, so a
cluster node that does not own the slot refuses them. One server (or a replicated primary) is
the supported index::

    mc:{ns}:o:<key>        hash   object record: size, dtype, shape, checksum, version, replicas,
                                  lease_until, last_access, created, refcount (mirror of live pins),
                                  chain_pos, chain_parent (prefix chains, for eviction), copies
                                  (replicas it was stored with: re-replication restores them)
    mc:{ns}:keys           set    every committed key (ls, stat)
    mc:{ns}:pend:<put_id>  hash   a put between reserve and commit (invisible to readers); a string
                                  "guard:<node>" for a spill batch's reservations on that peer (one
                                  per batch)
    mc:{ns}:pins:<key>     zset   pin id -> expiry ms; refcount = live pins
    mc:{ns}:claim:<key>    string writer id (PX ttl) while one writer stores a missing prefix chunk
    mc:{ns}:children       hash   parent key -> stored chunks naming it (survives the parent's removal)
    mc:{ns}:kids:<key>     set    the stored chunks naming the key as their chain parent (the children
                                  count's members: a pass evicts a chain's later chunks on other nodes)
    mc:{ns}:minchild       hash   parent key -> lowest chain position a child was committed at (while it has children)
    mc:{ns}:nodes          hash   node id -> node JSON (endpoints, shm name, zone, tiers, incarnation)
    mc:{ns}:hb             zset   node id -> heartbeat deadline ms
    mc:{ns}:reap           zset   node id -> when a reaper may purge it: its deadline plus its own TTL
    mc:{ns}:reaper         string the agent reaping now (PX one heartbeat interval): one at a time
    mc:{ns}:hb_last        string server ms of the last heartbeat of any node: a gap longer than a
                                  TTL is the index's own outage, after which no node is reaped at once
    mc:{ns}:nobj:<node>    set    keys with a replica on the node (reaping, per-node counts)
    mc:{ns}:tobj:<node>:<tier>  set  keys with a replica on that tier of the node (victim samples)
    mc:{ns}:repair:<node>  set    keys short of the replicas they were stored with since a node's
                                  purge, which this node holds and is to copy to another node
    mc:{ns}:acks:<node>    list   alloc ids committed since the agent's last sync
    mc:{ns}:acksout:<node> list   acks the last sync delivered, until the agent confirms it applied them
    mc:{ns}:gc:<node>      zset   alloc id -> time after which the agent may free it
    mc:{ns}:gcout:<node>   list   graves the last sync delivered, until the agent confirms them
    mc:{ns}:landed:<node>  zset   "<node>:<alloc id>" of the swaps that moved the node's replicas
                                  there -> swap ms (the last 120 s; for a mover whose reply was lost)
    mc:{ns}:held:<node>    zset   alloc id -> end of the read lease that ran when a purge took the
                                  node's replica there (a node that comes back keeps that memory till then)
    mc:{ns}:purging        set    nodes whose records are being purged (reaped or taken over)
    mc:{ns}:tags:<node>    zset   alloc tag -> when an incarnation of the node took it (the last day,
                                  PX a day): a new incarnation takes none of them
    mc:{ns}:purged:<node>  string set when a purge removed the node's record (PX a day), taken by its
                                  next registration: a record gone without one went with lost data;
                                  JSON {incarnation, hits: {tier: n}}, the hits given back to the
                                  same incarnation registering again ("1" from older builds)
    mc:{ns}:version        string object version counter
    mc:{ns}:stats          hash   hits, misses, evictions, hits:<node>:<tier>
    mc:{ns}:once:<token>   string the reply of a script call that must not run twice (a put, a remove),
                                  for its retry on a fresh connection (PX 10 s: one per such call made
                                  in the last 10 s, which is what to allow for when sizing maxmemory)

A replica travels as a compact JSON array ``[node_id, tier, offset, size, alloc_id, state]`` with
the alloc id as a string: Lua's cjson prints numbers with 14 significant digits.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from mooncake_store.errors import ConfigError, ProtocolError
from mooncake_store.types import (
    NodeInfo,
    ObjectMeta,
    Replica,
    ReplicaState,
    TierKind,
    TierUsage,
    TransportKind,
    parse_endpoint,
)

#: Keys per Lua call in batch operations: bounds the time one script holds the server.
BATCH_LIMIT = 4096


def in_batches(items: Sequence[Any], size: int = BATCH_LIMIT) -> Iterator[Sequence[Any]]:
    """``items`` in runs of at most ``size``: one Lua call each."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


#: What decoding a record not of this build's making (written by hand, or by another build) may
#: raise: a JSON number past float range (1e999, Infinity) is a float int() cannot take
#: (OverflowError), and deeply nested JSON exhausts the parser's stack (RecursionError). Each is a
#: ProtocolError naming the record, so that one bad row is left out, not every caller failed.
RECORD_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError)

log = logging.getLogger("mooncake.index")
_Row = TypeVar("_Row")
#: What malformed entries were warned of (bounded): each is logged once a process, not at every
#: pass or sync that meets it again.
_WARNED: set[str] = set()


def warn_once(what: str, exc: BaseException) -> None:
    if what not in _WARNED and len(_WARNED) < 1024:
        _WARNED.add(what)
        log.warning("%s passed over: %s (written by hand or by another build; left as it is)", what, exc)


def sound_rows(flat: Sequence[Any], width: int, decode: Callable[[Sequence[Any]], _Row], what: str) -> list[_Row]:
    """The rows of a script's flat reply (``width`` fields each, the first naming it) that decode;
    one that does not (a number Lua's tonumber took and int() does not, "1.5" or "1e999"; a tier
    this build does not know) is passed over, logged once: raised, it failed every pressure pass
    or repair of its node while the record was sampled."""
    rows: list[_Row] = []
    for start in range(0, len(flat), width):
        row = flat[start : start + width]
        try:
            rows.append(decode(row))
        except RECORD_ERRORS as exc:
            warn_once(f"{what} {str(row[0])[:80]!r}", exc)
    return rows


def sound_ints(values: Sequence[Any], what: str) -> list[int]:
    """The entries of ``values`` that are integers (alloc ids, graves), others passed over, logged."""
    out: list[int] = []
    for value in values:
        try:
            out.append(int(value))
        except RECORD_ERRORS as exc:
            warn_once(f"{what} {str(value)[:80]!r}", exc)
    return out


NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def key_prefix(namespace: str) -> str:
    if not NAMESPACE_RE.fullmatch(namespace):  # match() let a trailing newline through ($)
        raise ConfigError(f"namespace {namespace!r} must match [A-Za-z0-9_.-]{{1,64}}")
    return f"mc:{{{namespace}}}:"


def encode_replica(replica: Replica) -> list[Any]:
    return [
        replica.node_id,
        str(replica.tier),
        replica.offset,
        replica.size_bytes,
        str(replica.alloc_id),
        str(replica.state),
    ]


def decode_replicas(raw: str | bytes) -> tuple[Replica, ...]:
    try:
        items = json.loads(raw)
        if isinstance(items, dict):  # cjson encodes an empty table as {}
            return ()
        return tuple(
            Replica(
                node_id=str(node),
                tier=TierKind(tier),
                offset=_count(offset, "an offset"),
                size_bytes=_count(size, "a size"),
                alloc_id=_count(alloc, "an alloc id"),
                state=ReplicaState(state),
            )
            for node, tier, offset, size, alloc, state in items
        )
    except RECORD_ERRORS as exc:
        raise ProtocolError(f"malformed replica list in the index: {raw!r:.200} ({exc})") from None


def encode_shape(shape: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in shape)


#: The largest object size or dimension a record may name (an int64's): a negative size read
#: nothing and returned it as the count of bytes written, one past 2**63 failed in numpy.
MAX_RECORD_COUNT = (1 << 63) - 1


def _count(raw: str | bytes | float, what: str) -> int:
    # 1.5 in a replica list written by hand: int() made it 1, and the read copied from a place
    # one byte off, the wrong bytes unless the client verified checksums.
    if isinstance(raw, float) and not raw.is_integer():
        raise ValueError(f"{what} {raw!r} is no integer")
    number = int(raw)
    if not 0 <= number <= MAX_RECORD_COUNT:
        raise ValueError(f"{what} {number} is outside 0..{MAX_RECORD_COUNT}")
    return number


def decode_shape(raw: str) -> tuple[int, ...]:
    return tuple(_count(d, "a dimension") for d in raw.split(",")) if raw else ()


def decode_object(key: str, fields: list[Any]) -> ObjectMeta:
    size, dtype, shape, checksum, version, replicas = fields[:6]
    try:
        return ObjectMeta(
            key=key,
            size_bytes=_count(size, "the size"),
            dtype=_text(dtype),
            shape=decode_shape(_text(shape)),
            checksum=int(checksum),
            version=int(version),
            replicas=decode_replicas(replicas),
        )
    except RECORD_ERRORS as exc:
        raise ProtocolError(f"malformed object record for key {key!r:.80} in the index: {exc}") from None


def encode_node(info: NodeInfo, incarnation: str) -> str:
    return json.dumps(
        {
            "node_id": info.node_id,
            "incarnation": incarnation,
            "host": info.host,
            "host_id": info.host_id,
            "zone": info.zone,
            "pid": info.pid,
            "tcp_endpoint": info.tcp_endpoint,
            "shm_name": info.shm_name,
            "transports": [str(t) for t in info.transports],
            "tiers": encode_tiers(info.tiers),
            "started_ms": info.started_ms,
            "labels": info.labels,
            "alloc_tag": info.alloc_tag,
        }
    )


def encode_tiers(tiers: tuple[TierUsage, ...]) -> list[dict[str, Any]]:
    return [
        {
            "tier": str(t.tier),
            # As strings: the scripts re-encode node records with cjson, which prints numbers with 14
            # significant digits (a 112 TiB disk tier would come back rounded).
            "capacity": str(t.capacity_bytes),
            "used": str(t.used_bytes),
            "objects": str(t.objects),
            **({"block": str(t.block_bytes)} if t.block_bytes else {}),
            **({"largest": str(t.largest_free_bytes)} if t.largest_free_bytes else {}),
            **({"counters": {k: str(v) for k, v in t.counters.items()}} if t.counters else {}),
        }
        for t in tiers
    ]


def decode_node(raw: str | bytes, deadline_ms: int) -> NodeInfo:
    try:
        d = json.loads(raw)
        return NodeInfo(
            node_id=d["node_id"],
            host=d["host"],
            host_id=d["host_id"],
            zone=d["zone"],
            pid=int(d["pid"]),
            tcp_endpoint=_endpoint(d["tcp_endpoint"]),
            shm_name=d["shm_name"],
            transports=tuple(TransportKind(t) for t in d["transports"]),
            tiers=tuple(
                TierUsage(
                    tier=TierKind(t["tier"]),
                    capacity_bytes=int(t["capacity"]),
                    used_bytes=int(t["used"]),
                    objects=int(t.get("objects", 0)),
                    block_bytes=int(t.get("block", 0)),
                    largest_free_bytes=int(t.get("largest", 0)),
                    counters={k: int(v) for k, v in (t.get("counters") or {}).items()}
                    if isinstance(t.get("counters"), dict)
                    else {},
                )
                for t in (d["tiers"] if isinstance(d["tiers"], list) else [])
            ),
            heartbeat_deadline_ms=deadline_ms,
            started_ms=int(d.get("started_ms", 0)),
            last_heartbeat_ms=int(d.get("last_heartbeat_ms", 0)),
            labels=dict(d.get("labels") or {}),
            alloc_tag=int(d.get("alloc_tag") or 0),
        )
    except RECORD_ERRORS as exc:
        raise ProtocolError(f"malformed node record in the index: {raw!r:.200} ({exc})") from None


def _endpoint(raw: object) -> str:
    """A node row's endpoint, checked here: one that is no HOST:PORT was taken into the node table
    and failed every read of an object with a replica on that node, its other replicas unread."""
    if not isinstance(raw, str):
        raise TypeError(f"endpoint {raw!r:.40} is no string")
    try:
        parse_endpoint(raw)
    except ProtocolError as exc:
        raise ValueError(str(exc)) from None
    return raw


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def guard_value(node_id: str) -> str:
    """A spill guard's value: the node its reservations are on, whose reconcile after a rollback
    deletes a guard the restore brought back for reservations it no longer holds."""
    return "guard:" + node_id
