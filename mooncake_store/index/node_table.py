"""The index calls of the node table: registering an agent (or taking over a dead incarnation's
node id), heartbeats, leaving, reaping dead nodes, and reading the table. RedisIndex
(index/client.py) is built on this class; it supplies the connection and the scripts."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.client import NEVER_DECODE

from mooncake_store.errors import ConnectError, InvalidValue, MooncakeError, ProtocolError
from mooncake_store.index.schema import (
    RECORD_ERRORS,
    decode_node,
    decode_replicas,
    encode_node,
    encode_tiers,
    guard_value,
    in_batches,
)
from mooncake_store.types import NodeInfo, TierUsage

log = logging.getLogger("mooncake.index")

#: Malformed rows warned of (server, namespace, node id), bounded: each is logged once a process (a
#: row rewritten at every heartbeat would otherwise be logged at every read of the table).
_WARNED_ROWS: set[tuple[str, str, str]] = set()


@dataclass(frozen=True, slots=True)
class Registered:
    deadline_ms: int
    #: By alloc id, how long (ms) read leases still run on replicas that a purge of this node took
    #: from the index: an agent reaped while it stalled keeps their memory that long, since
    #: same-host readers copy from its arena under those leases (empty: none).
    held_ms: dict[int, int] = field(default_factory=dict)
    #: Whether a purge removed the node's last record (so held_ms names every lease running on
    #: what it took); False after a first registration or an index that lost its data.
    purged: bool = True


class IndexWentBack(MooncakeError):
    """The node record counts fewer of the agent's heartbeats and syncs than the agent was
    answered last: the index was restored from an older snapshot. ``count``: the record's."""

    def __init__(self, message: str, *, count: int) -> None:
        super().__init__(message)
        self.count = count


class NodeIdTaken(MooncakeError):
    """Registration refused: a live agent of another incarnation holds the node id. ``holder``:
    its node record; ``left_ms``: how long until its heartbeat deadline (0: unknown)."""

    def __init__(self, message: str, *, holder: dict[str, Any] | None = None, left_ms: int = 0) -> None:
        super().__init__(message)
        self.holder = holder or {}
        self.left_ms = left_ms


def holder_of(raw: str) -> dict[str, Any]:
    """The fields of the node row a registration was refused for, or {} for a row no JSON object
    decodes (written by hand, or by another build), which names no agent: its JSONDecodeError
    escaped the start."""
    try:
        holder = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return holder if isinstance(holder, dict) else {}


class NodeTableCalls:
    """RedisIndex's calls on the node table."""

    redis: redis.Redis
    prefix: str
    #: The URL as messages show it (password redacted).
    where: str
    #: RedisIndex._run: one script call, with its retry rules.
    _run: Callable[..., Any]

    def register_node(self, info: NodeInfo, *, incarnation: str, ttl_ms: int, beats: int = 0) -> Registered:
        """``beats``: the count of heartbeats and syncs the record starts from (an agent
        registering again after a reap starts far above its own, so that a snapshot from before
        the reap is told apart)."""
        for _ in range(100_000):  # each call purges a bounded slice of a dead incarnation's keys
            status = self._run("node_register", info.node_id, encode_node(info, incarnation), ttl_ms, beats)
            if status[0] != "PURGING":
                break
        if status[0] == "IN_USE":
            other = holder_of(status[1])
            left_ms = int(status[2]) - int(status[3]) if len(status) > 3 else 0
            held_s = max(0, left_ms) / 1000
            if not other:
                raise NodeIdTaken(
                    f"node id {info.node_id!r} is held for another {held_s:.1f} s, by its heartbeat deadline, by "
                    f"a record in the index this build cannot read ({str(status[1])[:80]!r}: written by hand or "
                    "by another build); it is purged and replaced once that has passed: start again then, "
                    "or pick another node id",
                    left_ms=max(0, left_ms),
                )
            raise NodeIdTaken(
                f"node id {info.node_id!r} is held by a live agent (pid {other.get('pid')} on "
                f"{other.get('host')}, held for another {held_s:.1f} s by its heartbeat deadline "
                "or a reconcile); pick another "
                "node id (`mooncake agent --node-id`; for `mooncake up`, whose agents are agent-0, agent-1, ...: "
                "another --namespace) or stop that agent",
                holder=other,
                left_ms=max(0, left_ms),
            )
        rows = status[2] if len(status) > 2 else []
        purged = len(status) < 4 or int(status[3]) == 1
        return Registered(int(status[1]), {int(rows[i]): int(rows[i + 1]) for i in range(0, len(rows), 2)}, purged)

    def heartbeat(
        self,
        node_id: str,
        *,
        incarnation: str,
        ttl_ms: int,
        tiers: tuple[TierUsage, ...],
        last_beats: int | None = None,
        reconciled: bool = False,
        interval_ms: int | None = None,
    ) -> int | None:
        """Extend the deadline; the record's count of the agent's heartbeats and syncs, which only
        grows while the index keeps its data, or None when the record is gone (the agent must
        register again). Given ``last_beats`` (the count answered last), a record with fewer (the
        index was restored from an older snapshot) is not extended but ended: IndexWentBack, and
        the node is unreadable until a beat passes a count it does not exceed (node_heartbeat.lua).
        Without it, such a record is extended and answers its count plus one. ``reconciled``: the
        agent brought the index in line with its tables after IndexWentBack; the record is
        extended whatever its count, which goes on from above ``last_beats`` (never back).
        ``interval_ms``: the agent's heartbeat interval, by which the index tells its own outage
        from a quiet cluster (a node whose TTL the outage passed gets its grace again)."""
        fields = json.dumps({"tiers": encode_tiers(tiers)})
        # Optional and positional in the script: the absent ones at the end are left out, one
        # before a given one is sent empty.
        optional: list[object] = [last_beats, "1" if reconciled else None, interval_ms]
        while optional and optional[-1] is None:
            optional.pop()
        extra = tuple("" if value is None else value for value in optional)
        status = self._run("node_heartbeat", node_id, incarnation, ttl_ms, fields, *extra)
        if status[0] == "BEHIND":
            raise went_back(node_id, int(status[1]), last_beats or 0)
        if status[0] != "OK":
            return None
        return int(status[2]) if len(status) > 2 else 1

    def deregister_node(self, node_id: str, *, incarnation: str) -> None:
        for _ in range(10_000):
            if int(self._run("node_deregister", node_id, incarnation, 5000)) <= 0:
                return

    def reap_dead_nodes(
        self,
        *,
        grace_ms: int | None = None,
        older_grace_ms: int | None = None,
        reaper: str = "",
        turn_ms: int = 0,
        max_keys: int = 5000,
    ) -> list[str]:
        """Purge the records of dead nodes; returns those purged completely. ``grace_ms``: every
        node past its deadline by more than it. None: each node past its deadline by its own
        heartbeat TTL, and a node whose agent (an older version) records no TTL by
        ``older_grace_ms``. ``turn_ms`` > 0: no other reaper may purge for that long after this one
        (``reaper``) did, so many agents do not all purge a large dead node at once."""
        if grace_ms is None and older_grace_ms is None:
            raise InvalidValue("reap_dead_nodes needs grace_ms or older_grace_ms")
        grace = "" if grace_ms is None else grace_ms
        return list(self._run("node_reap", grace, max_keys, older_grace_ms or 0, reaper, turn_ms))

    def heartbeat_recorded(self) -> bool:
        """Whether an agent of this namespace has heartbeat since the index last started empty
        (``hb_last``, which no deregistration removes): an empty node table without it is an
        index that restarted, whose agents register again at their next heartbeats; with it,
        agents that left."""
        try:
            return bool(self.redis.exists(self.prefix + "hb_last"))
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read the node table from {self.where}: {exc}") from None

    def forgotten(self, node_ids: list[str]) -> list[str]:
        """Of ``node_ids``, nodes no longer in the node table, those that neither left nor were
        reaped (a purge marks each for a day: ``purged:<node>``): the index forgot them, as one
        that restarted empty does, and they register again at their next heartbeats."""
        if not node_ids:
            return []
        try:
            marks = self.redis.mget([self.prefix + "purged:" + node for node in node_ids])
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read the node table from {self.where}: {exc}") from None
        return [node for node, mark in zip(node_ids, marks, strict=True) if mark is None]

    def nodes(self) -> dict[str, NodeInfo]:
        """Every registered node (live or not) with its heartbeat deadline; one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        # Read as bytes, decoded row by row: one row of bytes that are no UTF-8 failed the whole
        # read (the connection decodes replies), and with it every client, stat and agent start.
        pipe.execute_command("HGETALL", self.prefix + "nodes", **{NEVER_DECODE: True})
        pipe.execute_command(
            "ZRANGE", self.prefix + "hb", 0, -1, "WITHSCORES", **{NEVER_DECODE: True, "withscores": True}
        )
        try:
            records, deadlines = pipe.execute()
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read the node table from {self.where}: {exc}") from None
        deadline_of: dict[bytes, int] = {}
        for member, score in deadlines:
            with contextlib.suppress(*RECORD_ERRORS):  # inf: that node reads as past its deadline
                deadline_of[member] = int(score)
        table: dict[str, NodeInfo] = {}
        for raw_node, raw in records.items():
            node = raw_node.decode(errors="backslashreplace")
            try:
                raw_node.decode()  # an id of bytes that are no UTF-8 names no agent of this build
                table[node] = decode_node(raw, deadline_of.get(raw_node, 0))
            except (ProtocolError, UnicodeDecodeError) as exc:
                # Left out, named once: one row written by hand or by another build failed every
                # client's gets, puts and stat in the namespace, naming no node.
                # Once per row of one namespace: the same id in another namespace is another row.
                row = (self.where, self.prefix, node)
                if row not in _WARNED_ROWS and len(_WARNED_ROWS) < 1024:
                    _WARNED_ROWS.add(row)
                    log.warning("node %r left out of the node table at %s: %s", node, self.where, exc)
        return table

    def node_replicas(self, node_id: str) -> dict[int, str]:
        """alloc id -> key of every replica the index lists on ``node_id`` (its nobj set, then the
        objects' records in batches): what an agent checks its own tables against when the index
        went back in time. Not one atomic read: an object changed meanwhile is seen either way."""
        out: dict[int, str] = {}
        try:
            keys = list(self.redis.sscan_iter(self.prefix + "nobj:" + node_id, count=1000))
            for batch in in_batches(keys):
                pipe = self.redis.pipeline(transaction=False)
                for key in batch:
                    pipe.hget(self.prefix + "o:" + key, "replicas")
                for key, raw in zip(batch, pipe.execute(), strict=True):
                    try:
                        replicas = decode_replicas(raw) if raw else ()
                    except ProtocolError as exc:
                        # Left as it is (no reader gets bytes through it: lookups refuse it too),
                        # rather than fail the reconcile, and with it the node, at every beat.
                        log.warning("node %s's replicas: o:%s left out: %s", node_id, key, exc)
                        continue
                    for replica in replicas:
                        if replica.node_id == node_id:
                            out[replica.alloc_id] = key
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read the replicas of node {node_id} from {self.where}: {exc}") from None
        return out

    def pending_on_node(self, node_id: str) -> tuple[dict[str, set[int]], set[str]]:
        """What the pending records (``pend:*``) say of ``node_id``, found by SCAN (a walk of the
        whole keyspace, for the rare reconcile after the index went back in time): put id -> the
        alloc ids on the node of every pending put (entries this build cannot read are left
        out), and the put ids of the spill guards for reservations on it (pressure.py)."""
        puts: dict[str, set[int]] = {}
        guards: set[str] = set()
        head = self.prefix + "pend:"
        try:
            names = list(self.redis.scan_iter(match=head + "*", count=1000))
            for batch in in_batches(names):
                pipe = self.redis.pipeline(transaction=False)
                for name in batch:
                    pipe.hget(name, "entry")
                strings = []
                for name, raw in zip(batch, pipe.execute(raise_on_error=False), strict=True):
                    if isinstance(raw, redis.ResponseError):  # WRONGTYPE: a guard, a string
                        strings.append(name)
                    elif raw is not None and (allocs := _allocs_on(raw, node_id)):
                        puts[name[len(head) :]] = allocs
                if strings:
                    for name, value in zip(strings, self.redis.mget(strings), strict=True):
                        if value == guard_value(node_id):
                            guards.add(name[len(head) :])
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read the pending puts of node {node_id} from {self.where}: {exc}") from None
        return puts, guards

    def recent_alloc_tags(self, node_id: str, *, within_ms: int) -> tuple[int, set[int]]:
        """(the index's time in ms, the alloc tags incarnations of ``node_id`` took in the last
        ``within_ms``, as note_alloc_tag recorded them): whether or not their records are still
        listed (a record is gone once its node stopped or was reaped, while a commit naming one
        of its allocations may still be on its way)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(self.prefix + "tags:" + node_id, 0, -1, withscores=True)
        try:
            (seconds, micros), rows = pipe.execute()
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read the alloc tags of {node_id} from {self.where}: {exc}") from None
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        return now_ms, {int(tag) for tag, at in rows if at >= now_ms - within_ms}

    def note_alloc_tag(self, node_id: str, tag: int, *, now_ms: int, keep_ms: int) -> None:
        """Record ``tag`` as taken by an incarnation of ``node_id`` at ``now_ms``; the record of a
        node id that no incarnation takes again for ``keep_ms`` goes by itself."""
        key = self.prefix + "tags:" + node_id
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(key, {str(tag): now_ms})
        pipe.zremrangebyscore(key, "-inf", now_ms - keep_ms - 1)
        pipe.pexpire(key, keep_ms)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            raise ConnectError(f"cannot record the alloc tag of {node_id} on {self.where}: {exc}") from None


def _allocs_on(entry: str | bytes, node_id: str) -> set[int]:
    """The alloc ids on ``node_id`` that a pending put's entry (put_start.lua) names; none for an
    entry this build cannot read."""
    try:
        return {int(r[4]) for r in json.loads(entry)["replicas"] if r[0] == node_id}
    except RECORD_ERRORS:
        return set()


def went_back(node_id: str, count: int, last: int) -> IndexWentBack:
    return IndexWentBack(
        f"the index counts {count} heartbeats and syncs of node {node_id}, fewer than the {last} it "
        "answered last: it was restored from an older snapshot",
        count=count,
    )
