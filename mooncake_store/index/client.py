"""RedisIndex: every index operation the agent and the client need, one round trip each (those of an
agent's pressure pass in index/pressure.py, those of the node table in index/node_table.py, the
listing and the counts in index/listing.py)."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from mooncake_store.config import ClientConfig, redact_url
from mooncake_store.errors import ConnectError, InvalidValue, MooncakeError, ProtocolError
from mooncake_store.index.connection import ClosedPool, close_pool, connect_redis
from mooncake_store.index.listing import ListingCalls
from mooncake_store.index.node_table import NodeTableCalls, went_back
from mooncake_store.index.pressure import PressureCalls
from mooncake_store.index.schema import (
    decode_object,
    encode_replica,
    encode_shape,
    in_batches,
    key_prefix,
    sound_ints,
    warn_once,
)
from mooncake_store.index.scripts import ONCE_TTL_MS, load_scripts
from mooncake_store.types import ObjectMeta, Replica

#: A script call with a token (not REPLAY_SAFE) whose connection broke is retried only this soon
#: after it was sent: the server keeps its first run's reply for the retry ONCE_TTL_MS, and the
#: retry's connect may take up to 5 s more (connection.py).
RETRY_WITHIN_S = ONCE_TTL_MS / 4 / 1000

#: What the scripts say of an index record they cannot read (a hand edit, another
#: build): a ProtocolError naming the record, not a failed script.
MALFORMED_SAID = "malformed replica list in the index record "

#: Decoded lookup records kept for reuse (an object read again decodes to the same ObjectMeta).
DECODED_MEMO_ENTRIES = 16_384


#: How long an agent whose record vanished with no purge holds its objects' memory (a client's
#: default read lease), and the longest a read trusts its lease without asking the index again. A
#: purge records the leases running on what it took (held:<node>), but an index that lost its
#: data (restarted empty, flushed) lost the leases it granted with it, and a same-host reader
#: still copying under one would read another object's bytes from the reused memory.
VANISHED_HOLD_MS = ClientConfig().lease_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingPut:
    put_id: str
    key: str
    size_bytes: int
    dtype: str
    shape: tuple[int, ...]
    checksum: int
    replicas: tuple[Replica, ...]
    chain_pos: int | None = None  # position in a prefix chain: eviction takes later chunks first
    chain_parent: str | None = None  # key of the chunk before this one in its prefix chain


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResult:
    now_ms: int
    objects: list[ObjectMeta | None]
    lease_until_ms: list[int]

    def lease_left_ms(self, default_ms: int) -> int:
        """The shortest lease this lookup granted among the objects found (``default_ms`` if none),
        at most VANISHED_HOLD_MS: the time its reads may take before they must be checked against
        the index again. An index that lost its data lost the leases with it, and an agent then
        holds its memory only VANISHED_HOLD_MS: a reader under a longer lease (client.lease_ms up
        to an hour) copied on past that, out of memory reused by then."""
        granted = min(
            (u - self.now_ms for u, m in zip(self.lease_until_ms, self.objects, strict=True) if m),
            default=default_ms,
        )
        return min(granted, VANISHED_HOLD_MS)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncResult:
    acked_alloc_ids: list[int]
    expired_status: list[str]
    graves: list[int]
    #: Keys of the acked allocations that a peer moved onto this agent's disk tier.
    acked_keys: dict[int, str] = field(default_factory=dict)
    #: The node record's count of heartbeats and syncs, this sync's included.
    count: int = 0


class IndexSilent(ConnectError):
    """The index server did not answer a script within the timeout (stalled, or far too busy): a
    caller does not ask it again on the same path (a put's revoke would wait out a second timeout)."""


class NodeSuperseded(MooncakeError):
    """The node record belongs to another incarnation (or is gone): this agent's syncs must wait
    until it registers again, or stop."""


class RedisIndex(NodeTableCalls, PressureCalls, ListingCalls):
    """The index of one namespace. Thread-safe (redis-py pools its connections)."""

    #: Scripts whose second run, should a retry repeat a call whose reply was lost, answers as the
    #: first did: reads, lease grants and pins (the same member again), heartbeats, and swaps
    #: (plan_swap answers OK for a location it already holds). The rest run with a token
    #: (index/scripts.py): at most once per call.
    REPLAY_SAFE = frozenset(
        {
            "lookup",
            "victims",
            "node_heartbeat",
            "move_replica",
            "move_replicas",
            "prefix_match",
            "prefix_refcount",
            "drop_corrupt",  # a second run finds the replica gone
            "copy_replicas",  # plan_copy answers OK for a copy it already added
            "repair_candidates",  # a second run lists what the first did
        }
    )

    def __init__(self, url: str, *, namespace: str = "default", timeout_s: float = 10.0) -> None:
        self.url = url
        #: The URL as messages show it: a password in it stays out of errors and logs.
        self.where = redact_url(url)
        self.namespace = namespace
        self.prefix = key_prefix(namespace)
        self.redis = connect_redis(url, timeout_s=timeout_s)
        self._scripts = load_scripts(self.redis)
        # Connections that scripts run on directly (see _run), taken from redis-py's pool once.
        self._script_conns: list[Any] = []
        self._closed = False
        self._script_pid = os.getpid()
        self._decoded: dict[str, tuple[tuple[Any, ...], ObjectMeta]] = {}  # see lookup

    def close(self) -> None:
        """Disconnect, for good: a call racing close() (or made after it) fails with ConnectError
        rather than open a new connection that nothing would close. redis-py reconnects a closed
        pool's connections on demand, so the client gets a pool that refuses them."""
        self._closed = True
        conns, self._script_conns = self._script_conns, []
        pool, self.redis.connection_pool = self.redis.connection_pool, ClosedPool(self.where)
        for conn in conns:
            conn.disconnect()
        close_pool(pool)

    def preload(self, names: Sequence[str]) -> None:
        """Load the named scripts into the server now, those it lacks, in one round trip to ask
        and one to load: otherwise the first call of each meets NOSCRIPT, and loads (compiles)
        it then, on the path that waited for it (an agent's first spill, say)."""
        scripts = [self._scripts[name] for name in names]
        try:
            known = self.redis.script_exists(*(s.sha for s in scripts))
            pipe = self.redis.pipeline(transaction=False)
            for script, there in zip(scripts, known, strict=True):
                if not there:
                    pipe.script_load(script.script)
            pipe.execute()
        except redis.RedisError as exc:
            raise ConnectError(f"cannot load scripts into Redis at {self.where}: {exc}") from None

    def _run(self, name: str, *args: Any, scripts: Mapping[str, Any] | None = None, raw: bool = False) -> Any:
        """EVALSHA of one script on a connection of our own.

        redis-py's command path (pool checkout with a readiness poll, retry wrapper, observability
        hooks) costs about 60 µs per call on this class of machine, a third of a 4 KiB get; the
        Lua script itself costs 15-25 µs. So each script call sends and reads on a connection
        taken from the pool once and kept. A NOSCRIPT (server restarted or SCRIPT FLUSH) loads
        the script and runs it again; a broken connection is dropped, with every kept one (a
        restarted server broke them all), and the call retried once on a fresh one from the
        pool, which checks it, as redis-py's default retry did. The reply of a first run lost with the
        connection comes back to the retry instead of a second run (REPLAY_SAFE, scripts.py).
        ``raw``: the reply as bytes, for a caller that decodes it entry by entry (the connection
        decodes replies, and one entry of bytes that are no UTF-8 failed the whole reply)."""
        if self._closed:
            raise ConnectError(f"the index client for {self.where} is closed")
        script = (scripts or self._scripts)[name]
        if name in self.REPLAY_SAFE:
            command: tuple[Any, ...] = ("EVALSHA", script.sha, 0, self.prefix, *args)
        else:  # the retry below must not run it twice (index/scripts.py)
            token = self.prefix + "once:" + uuid.uuid4().hex
            command = ("EVALSHA", script.sha, 1, token, self.prefix, *args)
        if self._script_pid != os.getpid():  # a forked child must not share its parent's sockets
            self._script_conns, self._script_pid = [], os.getpid()
        sent = time.monotonic()
        for attempt in (0, 1):
            conn = None
            if attempt == 0:  # the retry takes a connection the pool checks (see below)
                with contextlib.suppress(IndexError):
                    conn = self._script_conns.pop()
            try:
                if conn is None:
                    conn = self.redis.connection_pool.get_connection()
                try:
                    conn.send_command(*command)
                    reply = conn.read_response(disable_decoding=raw)
                except redis.exceptions.NoScriptError:
                    conn.send_command("SCRIPT", "LOAD", script.script)
                    conn.read_response()
                    conn.send_command(*command)
                    reply = conn.read_response(disable_decoding=raw)
            except redis.exceptions.BusyLoadingError as exc:
                # redis-py makes it a ConnectionError, but the connection is fine and the reply was
                # read whole: the server restarted and is loading its persisted data, which a retry
                # at once would find too. It said "lost the connection". (None: the pool's own
                # handshake met it, and the pool took its connection back.)
                if conn is not None:
                    self._keep_conn(conn)
                raise ConnectError(
                    f"Redis at {self.where} is loading its data (it restarted) and answers no {name} until it "
                    f"has: {exc}"
                ) from None
            except redis.ConnectionError as exc:
                self._drop_conn(conn)
                # The server restarted, or a proxy cut every connection: the kept ones broke with
                # this one. Retrying on the next kept one failed as this did, so after a restart
                # a client that had kept N connections failed about N/2 of its next calls.
                self._drop_kept_conns()
                late = time.monotonic() - sent
                if attempt == 0 and (name in self.REPLAY_SAFE or late < RETRY_WITHIN_S):
                    continue
                # A run with a token keeps its reply ONCE_TTL_MS for the retry: a retry later than
                # that (this process stalled, or the break came late) would run it a second time
                # (an agent_sync run twice drops the acks the first one carried).
                why = f" after {late:.1f} s, too late to retry safely" if attempt == 0 else ""
                raise ConnectError(f"lost the connection to Redis at {self.where}{why}: {exc}") from None
            except redis.TimeoutError as exc:
                self._drop_conn(conn)
                raise IndexSilent(f"Redis at {self.where} did not answer {name}: {exc}") from None
            except redis.ResponseError as exc:
                self._keep_conn(conn)  # the reply was read whole: the connection is fine
                said = str(exc)
                if MALFORMED_SAID in said:
                    # The scripts' own word on a record they cannot read (prelude's
                    # record_replicas), which names it. The server's wrapping (Redis 6.2's "Error
                    # running script (call to f_...): " before it, a "script: on @user_script:N"
                    # tail after it) points into the script, not at the record.
                    named = said[said.index(MALFORMED_SAID) :].split(" script: ")[0]
                    raise ProtocolError(f"{named} (namespace {self.prefix!r} at {self.where})") from None
                advice = self._oom_advice(exc)
                raise MooncakeError(f"index script {name} failed on {self.where}: {exc}{advice}") from None
            except UnicodeDecodeError as exc:
                # The connection decodes replies: bytes that are no UTF-8 in a record or a key
                # name (written by hand, or by another build) escaped as a bare UnicodeDecodeError.
                self._drop_conn(conn)  # failed mid-reply: the stream may be out of step
                raise ProtocolError(
                    f"index script {name} was answered bytes that are no UTF-8 ({exc}): a record or key name in "
                    f"namespace {self.prefix!r} at {self.where} written by hand or by another build"
                ) from None
            except redis.RedisError as exc:
                # The rest of what redis-py raises: InvalidResponse above all, bytes that are no
                # Redis protocol (another service took the port after the server went, a proxy's
                # fault). It escaped the SDK as a bare redis-py error, past every MooncakeError
                # handler, where every other failure of the index is one.
                self._drop_conn(conn)  # the stream is out of step
                raise ProtocolError(
                    f"index script {name}: Redis at {self.where} answered what is no Redis reply "
                    f"({type(exc).__name__}: {exc})"
                ) from None
            except BaseException:
                self._drop_conn(conn)  # interrupted mid-reply: the stream may be out of step
                raise
            self._keep_conn(conn)
            return reply
        raise AssertionError("unreachable")

    def _keep_conn(self, conn: Any) -> None:
        """Keep a script connection for the next call, unless close() ran meanwhile."""
        self._script_conns.append(conn)
        if self._closed:
            # close() sets _closed before it takes the list: one that took it before this append
            # left the connection in a list nobody closes (a descriptor until the object went).
            while self._script_conns:
                with contextlib.suppress(IndexError):
                    self._script_conns.pop().disconnect()

    def _drop_kept_conns(self) -> None:
        """Each kept connection is taken off the list before it is closed: a call of another
        thread pops them from it too, and one taken by both was closed under that call and handed
        to the pool while it ran."""
        while True:
            try:
                conn = self._script_conns.pop()
            except IndexError:
                return
            self._drop_conn(conn)

    def _drop_conn(self, conn: Any) -> None:
        if conn is not None:
            conn.disconnect()
            self.redis.connection_pool.release(conn)

    # ---- puts -----------------------------------------------------------------------------
    def put_start(self, puts: Sequence[PendingPut], *, ttl_ms: int) -> None:
        for chunk in in_batches(puts):
            entries = [
                {
                    "put_id": p.put_id,
                    "key": p.key,
                    "size": p.size_bytes,
                    "dtype": p.dtype,
                    "shape": encode_shape(p.shape),
                    "checksum": str(p.checksum),
                    "replicas": [encode_replica(r) for r in p.replicas],
                    **({"chain_pos": p.chain_pos} if p.chain_pos is not None else {}),
                    **({"chain_parent": p.chain_parent} if p.chain_parent else {}),
                }
                for p in chunk
            ]
            self._run("put_start", ttl_ms, json.dumps(entries))

    def put_commit(self, put_ids: Sequence[str], *, checksums: Sequence[int] | None = None) -> list[str]:
        """Commit pending puts; one status per id (put_commit.lua). ``checksums``, one per id, are
        those of the bytes as they landed and replace the pending records' own."""
        if checksums is None:
            args: list[str] = list(put_ids)
        else:
            if len(checksums) != len(put_ids):
                raise InvalidValue(f"{len(put_ids)} put ids but {len(checksums)} checksums")
            bad = [c for c in checksums if type(c) is not int or not 0 <= c < 1 << 64]
            if bad:
                raise InvalidValue(f"checksums must be ints in 0..2**64-1, got {bad[0]!r:.80}")
            args = [f"{put_id}={checksum}" for put_id, checksum in zip(put_ids, checksums, strict=True)]
        out: list[str] = []
        for chunk in in_batches(args):
            out.extend(self._run("put_commit", *chunk))
        return out

    def put_revoke(self, put_ids: Sequence[str]) -> int:
        return sum(int(self._run("put_revoke", *chunk)) for chunk in in_batches(put_ids)) if put_ids else 0

    # ---- reads ----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[str], *, lease_ms: int, counted: bool = True) -> LookupResult:
        """Readable replicas of ``keys``, each found one leased for ``lease_ms`` (0: none, and no
        access-time update). ``counted``: with a lease, the keys count as hits and misses in stats
        (a retry of keys an earlier lookup of the same call counted passes False)."""
        objects: list[ObjectMeta | None] = []
        leases: list[int] = []
        now_ms = 0
        memo = self._decoded
        for chunk in in_batches(keys):
            raw = self._run("lookup", lease_ms, "1" if counted else "0", *chunk)
            now_ms = int(raw[0])
            for key, item in zip(chunk, raw[1:], strict=True):
                if not item:
                    objects.append(None)
                    leases.append(0)
                    continue
                # Decoding (JSON replicas, enums, dataclasses) costs more than the dict lookup; an
                # ObjectMeta is immutable and wholly determined by the key and these six fields.
                # One entry per key, its last record's: keyed by the fields too, every replace of
                # a key read again left an entry for a record gone (~1 KiB each, to the cap).
                fields = tuple(item[:6])
                known = memo.get(key)
                if known is not None and known[0] == fields:
                    meta = known[1]
                else:
                    if known is None and len(memo) >= DECODED_MEMO_ENTRIES:
                        memo.clear()
                    meta = decode_object(key, item)
                    memo[key] = (fields, meta)
                objects.append(meta)
                leases.append(int(item[6]))
        return LookupResult(now_ms=now_ms, objects=objects, lease_until_ms=leases)

    def remove(self, keys: Sequence[str]) -> list[int | str]:
        out: list[int | str] = []
        for chunk in in_batches(keys):
            out.extend(self._run("remove", *chunk))
        return out

    def agent_sync(
        self,
        node_id: str,
        *,
        incarnation: str,
        expired_put_ids: Sequence[str],
        applied_last: bool,
        max_graves: int = 1000,
        last_count: int | None = None,
    ) -> SyncResult:
        """What happened to the node's memory since its last confirmed sync. ``applied_last``: the
        agent received and applied the reply of its previous call; if not, that reply's acks and
        graves come again (agent_sync.lua). Raises NodeSuperseded when the node record is not
        ``incarnation``'s, and IndexWentBack, draining nothing, when it counts fewer heartbeats
        and syncs than ``last_count`` (the count the agent was answered last)."""
        last = "" if last_count is None else str(last_count)
        # Read as bytes and decoded entry by entry: an ack or grave of bytes that are no UTF-8
        # (pushed by hand, or by another build) failed the whole reply, which then came again.
        reply = self._run(
            "agent_sync",
            node_id,
            max_graves,
            "1" if applied_last else "0",
            incarnation,
            last,
            *expired_put_ids,
            raw=True,
        )
        if reply == [b"SUPERSEDED"]:
            raise NodeSuperseded(
                f"node {node_id} is not incarnation {incarnation[:12]}'s in the index (reaped, or taken over)"
            )
        if reply[0] == b"BEHIND":
            raise went_back(node_id, int(reply[1]), last_count or 0)
        acks, statuses, graves, count = reply
        acked: list[int] = []
        keys: dict[int, str] = {}
        # An entry that is no alloc id (pushed by hand, or by another build) is passed over: raised,
        # the reply was never applied, the next sync was handed it again, and the node's syncs
        # failed for good (graves never freed, expired reservations never reclaimed).
        for ack in acks:
            alloc_id, tab, key = ack.partition(b"\t")
            numbers = sound_ints([alloc_id.decode(errors="backslashreplace")], f"the ack in acks:{node_id}")
            if not numbers:
                continue
            number = numbers[0]
            acked.append(number)
            if tab:
                try:
                    keys[number] = key.decode()
                except UnicodeDecodeError as exc:  # names no key of this build: the ack stands, unnamed
                    warn_once(f"the key of ack {number} in acks:{node_id}", exc)
        return SyncResult(
            acked_alloc_ids=acked,
            expired_status=[status.decode() for status in statuses],
            graves=sound_ints(
                [grave.decode(errors="backslashreplace") for grave in graves], f"a grave in gc:{node_id}"
            ),
            acked_keys=keys,
            count=int(count),
        )

    def server_time_ms(self) -> int:
        try:
            seconds, micros = self.redis.time()
        except redis.RedisError as exc:
            raise ConnectError(f"cannot read the server time from {self.where}: {exc}") from None
        return int(seconds) * 1000 + int(micros) // 1000

    def _oom_advice(self, exc: redis.ResponseError) -> str:
        """What to do about a script the server refused at its maxmemory: a get writes its read
        lease, so even reads fail then, and the server's own words say nothing of that. A script is
        refused at its first write, so the call changed nothing."""
        if not isinstance(exc, redis.exceptions.OutOfMemoryError) and "maxmemory" not in str(exc):
            return ""
        try:
            memory = self.redis.info("memory")
            usage = f" (used {memory.get('used_memory')} B of maxmemory {memory.get('maxmemory')} B)"
        except redis.RedisError:
            usage = ""
        return (
            f"; the index server is out of memory{usage}: reads fail too, since each writes its read "
            "lease. This call changed nothing. Raise the server's maxmemory, or remove objects "
            "(their index records are what fills it)"
        )

    def eviction_unsafe(self) -> str | None:
        """Why the server may lose index keys on its own, or None: a maxmemory-policy other than
        noeviction drops node records, object records and leases when memory is short, and the
        index then loses objects and arena memory without an error. None too where CONFIG is not
        allowed (a managed server): there is no telling."""
        try:
            policy = self.redis.config_get("maxmemory-policy").get("maxmemory-policy")
        except redis.RedisError:
            return None
        if policy in (None, "noeviction"):
            return None
        return (
            f"the server at {self.where} has maxmemory-policy {policy}: under memory pressure it evicts "
            "index keys (node and object records, leases), losing objects and arena memory without an "
            "error; set maxmemory-policy noeviction"
        )
