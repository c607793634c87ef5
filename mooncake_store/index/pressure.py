"""The index calls of an agent's memory pressure: the victim sample, the graveyard, the swaps that
move replicas (DESIGN.md §3.4), evictions, and what a mover asks when a swap's answer was lost.
RedisIndex (index/client.py) is built on this class; it supplies the connection and the scripts."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from mooncake_store.errors import ConnectError, InvalidValue
from mooncake_store.index.schema import (
    BATCH_LIMIT,
    RECORD_ERRORS,
    decode_replicas,
    encode_replica,
    guard_value,
    in_batches,
    sound_rows,
    warn_once,
)
from mooncake_store.types import EvictionCandidate, Replica, TierKind


@dataclass(frozen=True, slots=True)
class RepairCandidate:
    """An object short of its replicas, with a readable replica on the node asked."""

    key: str
    size_bytes: int
    alloc_id: int  # of the replica on the node asked
    tier: TierKind  # where that replica is
    missing: int  # replicas to add
    holders: tuple[str, ...]  # nodes with a replica: none is a target
    dtype: str = ""  # as put ("" when none was given)
    #: The copy missing is one a full node dropped under pressure: it goes only into room under a
    #: peer's low watermark, which no pressure pass takes back (else it would be copied back and
    #: dropped again while writers fill the cluster). A node's loss copies into room under the
    #: high watermark.
    thinned: bool = False


class PressureCalls:
    """RedisIndex's calls for a pressure pass."""

    redis: redis.Redis
    prefix: str
    #: The URL as messages show it (password redacted).
    where: str
    #: RedisIndex._run: one script call, with its retry rules.
    _run: Callable[..., Any]

    def victim_candidates(self, node_id: str, tier: str, *, sample: int = 256) -> list[EvictionCandidate]:
        flat = self._run("victims", node_id, tier, sample)
        return sound_rows(flat, 12, _victim, "the victim record o:")

    def pending_graves(self, node_id: str, *, limit: int = 4096) -> tuple[int, list[tuple[int, int]]]:
        """The node's graveyard, earliest due first: (server time ms, [(alloc id, due ms)]) of the
        removed, replaced and moved objects' old locations, freed once their leases run out."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(self.prefix + "gc:" + node_id, 0, limit - 1, withscores=True)
        try:
            (seconds, micros), graves = pipe.execute()
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read the graveyard of {node_id} from {self.where}: {exc}") from None
        due: list[tuple[int, int]] = []
        for alloc_id, at in graves:
            try:
                due.append((int(alloc_id), int(at)))
            except RECORD_ERRORS as exc:  # a grave no sync would free: passed over, not every pass failed
                warn_once(f"the grave {str(alloc_id)[:80]!r} in gc:{node_id}", exc)
        return int(seconds) * 1000 + int(micros) // 1000, due

    def replicas_listed(self, key: str) -> tuple[Replica, ...] | None:
        """Every replica ``key``'s record lists, on live nodes or not (lookup leaves out nodes past
        their heartbeat deadline); None when there is no such object. For an agent asking whether
        the index names one of its own allocations: after an outage its own heartbeat may lag."""
        try:
            raw = self.redis.hget(self.prefix + "o:" + key, "replicas")
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read the replicas of {key!r} from {self.where}: {exc}") from None
        return None if raw is None else decode_replicas(raw)

    def buried(self, node_id: str, alloc_ids: Sequence[int]) -> set[int]:
        """Those of ``alloc_ids`` that are in the node's graveyard now (any number, unlike
        pending_graves, which lists the earliest due)."""
        there = self._in_sorted_set("gc:" + node_id, [str(a) for a in alloc_ids], f"the graveyard of {node_id}")
        return {a for a, found in zip(alloc_ids, there, strict=True) if found}

    def landed(self, mover: str, targets: Sequence[tuple[str, int]]) -> set[tuple[str, int]]:
        """Those of ``targets`` (node id, alloc id of a new location) that a swap of ``mover``'s
        replicas moved an object to within the last LANDED_KEEP_MS (prelude.lua), whatever became
        of the object since."""
        members = [f"{n}:{a}" for n, a in targets]
        there = self._in_sorted_set("landed:" + mover, members, f"the landed moves of {mover}")
        return {t for t, found in zip(targets, there, strict=True) if found}

    def _in_sorted_set(self, key: str, members: list[str], what: str) -> list[bool]:
        """Whether each of ``members`` is in the sorted set ``key`` (one ZMSCORE; none asked, no
        round trip); ``what`` names the set in an error."""
        if not members:
            return []
        try:
            scores = self.redis.zmscore(self.prefix + key, members)
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read {what} from {self.where}: {exc}") from None
        return [score is not None for score in scores]

    def move_replica(self, key: str, *, old_node: str, old_alloc_id: int, new: Replica, promotion: bool = False) -> str:
        """Compare-and-swap a replica's location; move_replicas' statuses ("OK", "GONE", "PINNED",
        "EXPIRED", "DUP", "INVALID"). A ``promotion`` (to a faster tier of the same node) is not
        held back by pins: a pinned prefix chunk read from disk is the one most worth promoting."""
        replica = json.dumps(encode_replica(new))
        return str(self._run("move_replica", key, old_node, str(old_alloc_id), replica, "1" if promotion else "0"))

    def guard_reservations(self, put_ids: Sequence[str], *, node_id: str, ttl_ms: int) -> None:
        """Guard records for reservations made on another agent, ``node_id``: that agent's sync
        deletes one when its reservation times out, and move_replicas swaps only while it is
        still there. Each names the node (guard_value), for that agent's reconcile after the
        index went back in time."""
        pipe = self.redis.pipeline(transaction=False)
        for put_id in put_ids:
            pipe.set(self.prefix + "pend:" + put_id, guard_value(node_id), px=ttl_ms)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            raise ConnectError(f"cannot write reservation guards to {self.where}: {exc}") from None

    def drop_guards(self, put_ids: Sequence[str]) -> None:
        """Delete guard records that no swap will use (their reservations were refused): they
        would stay for their whole TTL, and refused spills are routine once peers fill."""
        try:
            self.redis.delete(*(self.prefix + "pend:" + put_id for put_id in put_ids))
        except redis.RedisError as exc:
            raise ConnectError(f"cannot delete reservation guards in {self.where}: {exc}") from None

    def move_replicas(self, moves: Sequence[tuple[str, int, Replica, str]], *, old_node: str) -> list[str]:
        """Compare-and-swap many of ``old_node``'s replicas, each (key, old alloc id, new location,
        guard put id or "") on its own with move_replica's rules; a status per move ("OK", "GONE",
        "PINNED", "EXPIRED" (the guard is gone, or the new node is), "DUP" (the new node holds
        another replica), "INVALID" (a malformed location)), in order. One round trip per
        BATCH_LIMIT moves, cut only between guards (guard_batches): the call that swaps deletes the
        guards it used, so moves sharing a guard go in one call."""
        return self._in_guard_batches("move_replicas", moves, old_node)

    def copy_replicas(self, copies: Sequence[tuple[str, int, Replica, str]], *, src_node: str) -> list[str]:
        """Add replicas copied from ``src_node``'s (key, its alloc id, new location, guard put id or
        ""), each on its own (copy_replicas.lua): re-replication after a node's loss. A status per
        copy ("OK", "GONE", "EXPIRED", "DUP", "WHOLE" (the object has its count of replicas already),
        "INVALID"), in order, one round trip per batch."""
        return self._in_guard_batches("copy_replicas", copies, src_node)

    def _in_guard_batches(self, script: str, moves: Sequence[tuple[str, int, Replica, str]], node: str) -> list[str]:
        out: list[str] = []
        for chunk in guard_batches(moves):
            args: list[str] = []
            for key, old_alloc_id, new, guard in chunk:
                args += (key, str(old_alloc_id), json.dumps(encode_replica(new)), guard)
            out.extend(str(s) for s in self._run(script, node, *args))
        return out

    def repair_candidates(self, node_id: str, *, count: int = 256) -> list[RepairCandidate]:
        """Objects ``node_id`` is to copy to other nodes: short of the replicas they were stored
        with since a dead node's purge, a damaged copy's drop or a full node's eviction of a copy,
        and holding a readable replica here (repair_candidates.lua)."""
        flat = self._run("repair_candidates", node_id, count)
        return sound_rows(flat, 8, _repair_candidate, "the repair candidate o:")

    def evict(self, key: str, *, node_id: str, alloc_id: int) -> str:
        """Drop one replica (the object too if it was the last); "OK", "GONE", "PINNED", "LEASED"
        (read since the sample that chose it: its lease is live), "PARENT" (the last replica of a chunk that stored
        chunks of its chain hang off) or "MALFORMED" (a record this build cannot read)."""
        return self.evict_many([(key, alloc_id)], node_id=node_id)[0]

    def drop_corrupt(self, key: str, alloc_id: int, *, node_id: str) -> bool:
        """Drop ``node_id``'s replica ``alloc_id`` of ``key``, whose bytes failed their checksum
        there (drop_corrupt.lua); False when the object no longer lists it."""
        return str(self._run("drop_corrupt", node_id, key, str(alloc_id))) == "OK"

    def evict_many(self, victims: Sequence[tuple[str, int]], *, node_id: str, since_ms: int | None = None) -> list[str]:
        """Drop ``node_id``'s replicas (key, alloc id), each on its own and in order, with evict's
        statuses; one round trip per BATCH_LIMIT of them (a pass of small objects used to pay one
        per object). ``since_ms``: the index's time when the sample that chose them was taken; an
        object accessed after it, or in its very millisecond, stays ("TOUCHED")."""
        out: list[str] = []
        since = "" if since_ms is None else str(since_ms)
        for chunk in in_batches(victims):
            args = [x for key, alloc_id in chunk for x in (key, str(alloc_id))]
            out.extend(str(s) for s in self._run("evict", node_id, since, *args))
        return out

    def evict_chains(
        self,
        victims: Sequence[tuple[str, int]],
        *,
        node_id: str,
        tier: str,
        wanted_bytes: int,
        most_later: int,
        pressed_tiers: Sequence[str] = (),
        since_ms: int | None = None,
    ) -> tuple[int, int, list[str], list[int]]:
        """Cut the chains of ``node_id``'s replicas (key, alloc id) of chain chunks back from their
        leaves, wherever those are, then the chunks themselves (evict_chains.lua), in the order
        given, until ``wanted_bytes`` of the node's ``tier`` went; not those with a later chunk on
        one of the node's ``pressed_tiers`` (whose own passes move it). Returns the plain bytes
        freed there, the objects evicted in all, a status per victim, and the alloc ids of the
        node's tier that went (what they take there is the room made: on a disk tier, the blocks of
        their files). One round trip: the caller keeps ``victims`` few (each walks its chain in the
        script). ``since_ms``: the index's time when the sample that chose them was taken; nothing
        of a chain goes whose chunks were accessed after it ("TOUCHED")."""
        args = [x for key, alloc_id in victims for x in (key, str(alloc_id))]
        since = "" if since_ms is None else str(since_ms)
        raw = self._run("evict_chains", node_id, tier, wanted_bytes, most_later, ",".join(pressed_tiers), since, *args)
        count = len(victims)
        statuses = [str(s) for s in raw[2 : 2 + count]]
        return int(raw[0]), int(raw[1]), statuses, [int(a) for a in raw[2 + count :]]


def guard_batches(
    moves: Sequence[tuple[str, int, Replica, str]], size: int = BATCH_LIMIT
) -> list[Sequence[tuple[str, int, Replica, str]]]:
    """``moves`` (key, old alloc id, new location, guard) in runs of at most ``size``, one
    move_replicas call each, cut only where the guard changes (moves without one, "", anywhere):
    a call deletes the guards it used, so a guard's later moves in another call would come back
    EXPIRED and never move. Refused (InvalidValue, before anything is sent) when one guard's moves
    cannot share a call: more of them than ``size``, or not next to each other across a cut."""
    batches: list[Sequence[tuple[str, int, Replica, str]]] = []
    start = 0
    used: set[str] = set()  # guards of the batches already cut
    cur: set[str] = set()
    i = 0
    while i < len(moves):
        guard = moves[i][3]
        end = i + 1
        while guard and end < len(moves) and moves[end][3] == guard:
            end += 1
        if end - i > size:
            raise InvalidValue(f"{end - i} moves share the guard {guard!r}: one call takes at most {size}")
        if end - start > size:  # the run does not fit beside what is gathered: cut before it
            batches.append(moves[start:i])
            used |= cur
            start, cur = i, set()
        if guard in used:
            raise InvalidValue(
                f"the moves of guard {guard!r} are not next to each other: they would go in two calls "
                f"of at most {size}, and the first deletes the guard"
            )
        if guard:
            cur.add(guard)
        i = end
    if start < len(moves):
        batches.append(moves[start:])
    return batches


def _victim(row: Sequence[Any]) -> EvictionCandidate:
    return EvictionCandidate(
        key=row[0],
        size_bytes=int(row[1]),
        last_access_ms=int(row[2]),
        lease_until_ms=int(row[3]),
        pins=int(row[4]),
        alloc_id=int(row[5]),
        chain_pos=int(row[6]),
        dtype=row[7],
        children=int(row[8]),
        other_nodes=tuple(n for n in str(row[9]).split(",") if n),
        chain_parent=str(row[10]),
        survivor=str(row[11]) == "1",
    )


def _repair_candidate(row: Sequence[Any]) -> RepairCandidate:
    return RepairCandidate(
        key=row[0],
        size_bytes=int(row[1]),
        alloc_id=int(row[2]),
        tier=TierKind(row[3]),
        missing=int(row[4]),
        holders=tuple(n for n in str(row[5]).split(",") if n),
        dtype=str(row[6]),
        thinned=str(row[7]) == "1",
    )
