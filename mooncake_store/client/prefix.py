"""PrefixCache: KV-cache chunks of prompt prefixes, matched in one index round trip (per 4096
chunks) and shared.

::

    cache = PrefixCache(client, namespace="llama-3-8b/bf16/tp0", chunk_tokens=256)
    n = cache.match(token_ids)                 # tokens covered by stored chunks; one round trip per 4096 chunks
    cache.store(token_ids, chunks)             # one array per full chunk; existing chunks are skipped
    with cache.load(token_ids) as hit:         # pins the matched chunks while the block runs
        hit.num_tokens, hit.chunks
    fut = cache.load_async(token_ids)          # Future of the same hit

Each chunk is one object, keyed by a chained digest of the prefix up to its end (see
:mod:`mooncake_store.client.prefix_hash`). Requests that share a prefix share its objects: a chunk is
written once (concurrent writers claim missing chunks in the index, one round trip, and leave
chunks claimed by another writer to it) and read by all.

A hit pins its chunks: the index refuses to remove or replace a pinned object, and every policy
that frees or moves memory must skip it. Pins carry a lease (``pin_lease_s``) that a background
thread renews while the hit is held, so a client that dies stops pinning within one lease.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from mooncake_store.client.async_args import outs_as_now, snapshot, tokens_as_now
from mooncake_store.client.client import Client
from mooncake_store.client.in_flight import on_pool_thread
from mooncake_store.client.prefix_chunks import (
    check_chunks_alike,
    is_sequence_or_stack,
    kept_beside_chain,
    output_buffers,
    read_run,
    stored_layout,
    tail_tokens,
)
from mooncake_store.client.prefix_claims import Claims
from mooncake_store.client.prefix_hash import (
    BlockHash,
    block_hash_chain,
    chain_keys,
    check_namespace,
    token_chain,
)
from mooncake_store.client.prefix_pins import DroppedHits, renew_while_alive
from mooncake_store.config import redact_url
from mooncake_store.errors import ConfigError, ConnectError, InvalidValue, MooncakeError, NoCapacity, ObjectPinned
from mooncake_store.index.prefix import PrefixIndex
from mooncake_store.transport.cancel import Cancel
from mooncake_store.types import as_count, is_bool

#: A sequence of chunk arrays, or a function from chunk index to the array (called only for the
#: chunks that have to be written, so callers need not materialize chunks that are stored already).
Chunks = Sequence[object] | Callable[[int], object]
#: Destination buffers for load(): a sequence (one per chunk, at least as many as match), or a
#: function called with the number of matched chunks that returns that many buffers.
Outs = Sequence[object] | Callable[[int], Sequence[object]]

log = logging.getLogger("mooncake.client")
#: Upper bound of pin_lease_s and claim_ttl_s (about 115 days): a lease, not a forever.
MAX_SECONDS = 10_000_000
#: Upper bound of chunk_tokens.
MAX_CHUNK_TOKENS = 1 << 20
T = TypeVar("T")


class PrefixHit:
    """The matched prefix of one load(): pinned until :meth:`release` (or the end of a ``with``)."""

    def __init__(self, cache: PrefixCache, keys: list[str], chunks: list[Any], pin_id: str, chunk_tokens: int) -> None:
        self._cache = cache
        self.keys = keys
        self.chunks = chunks
        self.pin_id = pin_id
        self.num_chunks = len(keys)
        self.num_tokens = len(keys) * chunk_tokens
        self._released = not keys
        #: Serialises release and the renewal of this hit's pins: a renewal that read the hit as
        #: held must not pin it again after its release unpinned it.
        self._pin_lock = threading.Lock()
        self._on_drop: weakref.finalize | None = None  # unpins it if dropped unreleased (prefix_pins.py)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Unpin the chunks (idempotent). ``chunks`` stay valid: they are the caller's memory.
        In a forked child it only marks the hit released: the pins are the parent's, which still
        holds the hit."""
        self._let_go(unpin=True)

    def _let_go(self, *, unpin: bool) -> bool:
        """Mark the hit released and, with ``unpin``, unpin its chunks; False when the index could
        not be reached (its pins run out by their lease)."""
        if os.getpid() != self._cache.client._pid:
            # Before the lock, which a parent thread (its renewal) may have held at the fork.
            self._released = True
            return True
        with self._pin_lock:
            if self._released:
                return True
            self._released = True
            return self._cache._release(self, unpin=unpin)

    def __enter__(self) -> PrefixHit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PrefixHit(num_tokens={self.num_tokens}, num_chunks={self.num_chunks}, released={self._released})"


class PrefixCache:
    """Prefix-keyed KV chunks on a :class:`~mooncake_store.Client`. Thread-safe.

    ``namespace`` names the model and the KV layout (model id, dtype, layers, KV heads, head dim,
    TP rank): chunks are shared only within one namespace. ``chunk_tokens`` tokens make a chunk.
    ``pin_lease_s`` bounds how long a dead client's pins last; live hits are renewed every third
    of it. ``claim_ttl_s`` bounds how long a dead writer keeps others from writing its chunks; a
    live writer's claims are renewed every third of it.
    """

    def __init__(
        self,
        client: Client,
        namespace: str,
        chunk_tokens: int = 256,
        *,
        replicas: int = 1,
        pin_lease_s: float = 30.0,
        claim_ttl_s: float = 30.0,
        io_threads: int = 4,
    ) -> None:
        if not isinstance(client, Client):
            raise ConfigError(
                f"client must be a mooncake_store Client (from connect()), got {type(client).__name__}: {client!r:.80}"
            )
        counts: list[int] = []
        for name, given, top in (
            ("chunk_tokens", chunk_tokens, MAX_CHUNK_TOKENS),
            ("replicas", replicas, 16),
            ("io_threads", io_threads, 1024),
        ):
            count = as_count(given)  # a numpy integer too
            if count is None or not 1 <= count <= top:
                raise InvalidValue(f"{name} must be an int in 1..{top}, got {given!r:.80}")
            counts.append(count)
        chunk_tokens, replicas, io_threads = counts
        for name, seconds in (("pin_lease_s", pin_lease_s), ("claim_ttl_s", claim_ttl_s)):
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= MAX_SECONDS:
                raise InvalidValue(f"{name} must be a number of seconds in (0, {MAX_SECONDS}], got {seconds!r}")
        self.client = client
        self.namespace = check_namespace(namespace)
        self.chunk_tokens = chunk_tokens
        self.replicas = replicas
        self.pin_lease_ms = max(1, int(pin_lease_s * 1000))
        self.claim_ttl_ms = max(1, int(claim_ttl_s * 1000))
        self.index = PrefixIndex(client.index)
        self._dropped = DroppedHits(self.index)
        self._io_threads = io_threads
        # The worker threads of load_async and store_async, a pool each: a store waiting for room
        # (seconds, with the room pinned by hits) held the workers that loads, on the request
        # path, waited for.
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._held: weakref.WeakValueDictionary[str, PrefixHit] = weakref.WeakValueDictionary()
        #: Claims of stores under way, by writer id: renewed with the pins of held hits.
        self._claims: dict[str, Claims] = {}
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()  # set by close(), and by the client's (its renewal ends with it)
        client._watch_close(self._stop)
        self._closed = False
        self._closed_all = threading.Event()
        #: Loads and stores run under it: close() cuts their transfers short, the client staying open.
        self._ops = Cancel("PrefixCache is closed")

    # ---- keys -------------------------------------------------------------------------------
    def keys(
        self,
        token_ids: Any = None,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
        include_tail: bool = False,
    ) -> list[str]:
        """Object keys of the chunks of ``token_ids`` (full chunks, plus the partial last one with
        ``include_tail``), or of engine-supplied ``block_hashes`` (one full chunk each)."""
        if (token_ids is None) == (block_hashes is None):
            raise InvalidValue("pass token_ids or block_hashes (exactly one)")
        if not is_bool(include_tail):
            raise InvalidValue(f"include_tail must be a bool, got {type(include_tail).__name__}: {include_tail!r:.80}")
        if block_hashes is not None:
            digests = block_hash_chain(self.namespace, block_hashes)
        else:
            digests = token_chain(self.namespace, token_ids, self.chunk_tokens, include_tail=include_tail)
        return chain_keys(self.namespace, digests)

    def _tokens_of(self, token_ids: Any, block_hashes: Any, num_chunks: int, total_chunks: int) -> int:
        if block_hashes is not None or num_chunks < total_chunks:
            return num_chunks * self.chunk_tokens
        # Every key matched; the last one may be a partial tail.
        return min(num_chunks * self.chunk_tokens, len(token_ids))

    # ---- match ------------------------------------------------------------------------------
    def match(
        self,
        token_ids: Any = None,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
        include_tail: bool = True,
        max_tokens: int | None = None,
    ) -> int:
        """Tokens covered by the longest chain of stored chunks: one index round trip per 4096 chunks.

        A partial last chunk counts only if exactly that tail was stored (``store(...,
        include_tail=True)``). ``max_tokens`` caps the answer at a chunk boundary below it.
        """
        self._begin_call()
        keys = self._limit(self.keys(token_ids, block_hashes=block_hashes, include_tail=include_tail), max_tokens)
        with self.client._cut_by_close():
            found = self.index.match(keys).num_chunks
        return self._tokens_of(token_ids, block_hashes, found, len(keys))

    def _limit(self, keys: list[str], max_tokens: int | None) -> list[str]:
        if max_tokens is None:
            return keys
        count = as_count(max_tokens)
        if count is None or count < 0:
            raise InvalidValue(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        return keys[: count // self.chunk_tokens]

    # ---- store ------------------------------------------------------------------------------
    def store(
        self,
        token_ids: Any = None,
        chunks: Chunks = (),
        *,
        block_hashes: Sequence[BlockHash] | None = None,
        include_tail: bool = False,
        replicas: int | None = None,
        preferred_node: str | None = None,
    ) -> int:
        """Store the chunks of a prompt; returns how many chunks this call wrote.

        ``chunks[i]`` is chunk i's KV data (any buffer :meth:`Client.put` takes), for every full
        chunk (and the tail with ``include_tail``); a callable is asked only for chunks it must
        write. A chunk that is already stored, or that another writer is storing right now, is
        not written. One round trip decides which chunks to write, one put_many writes them. New
        chunks that hang off one another writer is storing wait for it (up to the client's
        ``timeout_s``; then they are not written), so none is committed under a missing parent.
        A prompt with more new chunks than the cluster's arenas hold at once, even empty, has its
        first chunks stored, as many as they hold (the return value says how many).
        """
        self._begin_call()
        keys = self.keys(token_ids, block_hashes=block_hashes, include_tail=include_tail)
        if not callable(chunks) and not is_sequence_or_stack(chunks):
            raise InvalidValue(
                f"chunks must be a sequence of chunk arrays or a callable chunk(i), got {type(chunks).__name__}"
            )
        # chunks[i] is chunk i: arrays past the last key (a longer sequence's) are not stored.
        if not callable(chunks) and len(chunks) < len(keys):
            raise InvalidValue(
                f"{len(keys)} chunk(s) of {self.chunk_tokens} tokens to store but {len(chunks)} chunk array(s) given"
            )
        tail = tail_tokens(token_ids, self.chunk_tokens)
        if not keys:
            return 0
        claims = Claims(self.index, keys, uuid.uuid4().hex, self.claim_ttl_ms)
        with self.client._cut_by_close():
            # A chunk this store would extend that another writer is storing is waited for as
            # long as a put may take (prefix_claims.py): committed under it unpinned, the new
            # chunks were left under a gap once it was evicted, or never stored.
            statuses = claims.claim(wait_s=self.client.config.timeout_s, sleep=self._sleep_open)
        if claims.given_up:
            log.info("store: %d chunk(s) not written: their parent is still being stored", len(claims.given_up))
        mine = [i for i, s in enumerate(statuses) if s == "MINE"]
        if not mine:
            if claims.guards:  # pinned for chunks given up since
                self._release_claims(claims)
            return 0
        self._hold_claims(claims)
        try:
            get = chunks if callable(chunks) else chunks.__getitem__
            values = {i: get(i) for i in mine}
            tail_index = len(keys) - 1 if include_tail and tail else None
            with self.client._cut_by_close():
                stored = stored_layout(self.client, keys, statuses, tail_index)
            check_chunks_alike(values, tail_index=tail_index, stored=stored)
            if stored is not None:  # it extends a stored chain: do the new chunks fit beside it?
                with self.client._cut_by_close():
                    mine = kept_beside_chain(
                        self.client, keys, statuses, values, stored[2],
                        replicas=self.replicas if replicas is None else replicas, preferred_node=preferred_node,
                    )  # fmt: skip
                if not mine:
                    log.info("store: the nodes keep no new chunk beside the stored chain it extends")
                    return 0
            mine = self._write_chunks(keys, values, mine, replicas=replicas, preferred_node=preferred_node)
        except ObjectPinned as exc:
            # A chunk that another client's hit pins, and whose every copy went with a dead node
            # (it was claimed as unreadable): it cannot be replaced until those pins go (their
            # holders read it already) or the reaper drops its record. The rest were stored.
            log.info("store of %d chunk(s): %d pinned ones not written: %s", len(mine), len(exc.pinned), exc)
            return len(exc.done)
        finally:
            self._release_claims(claims)
        return len(mine)

    def _write_chunks(
        self,
        keys: list[str],
        values: dict[int, Any],
        mine: list[int],
        *,
        replicas: int | None,
        preferred_node: str | None,
    ) -> list[int]:
        """Put the chunks ``mine`` (indices into ``keys``, in chain order) in one batch, chained;
        returns those written. More new chunks than the cluster holds at once, even empty, are cut
        to the first ones it keeps (NoCapacity.batch_limit: a prefix, as eviction would have left
        it), not refused whole: the caller, who chose no batch, cannot send smaller ones."""
        while True:
            try:
                with self._ops.active():
                    self.client.put_many(
                        {keys[i]: values[i] for i in mine},
                        replicas=self.replicas if replicas is None else replicas,
                        preferred_node=preferred_node,
                        # Eviction takes only chunks with no stored children, so chains stay
                        # prefix-closed.
                        chain_pos={keys[i]: i for i in mine},
                        chain_parent={keys[i]: keys[i - 1] for i in mine if i > 0},
                    )
                return mine
            except NoCapacity as exc:
                if not exc.batch_limit or exc.batch_limit >= len(mine):
                    raise
                kept = exc.batch_limit
                log.info("store: the cluster keeps %d of the prompt's %d new chunk(s): those written", kept, len(mine))
                mine = mine[:kept]

    # ---- load -------------------------------------------------------------------------------
    def load(
        self,
        token_ids: Any = None,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
        outs: Outs | None = None,
        include_tail: bool = True,
        max_tokens: int | None = None,
    ) -> PrefixHit:
        """Match, pin and read the longest stored prefix. Use as ``with cache.load(ids) as hit:``.

        One round trip matches and pins; one get_many reads the chunks (into ``outs`` when given,
        with no intermediate copy; ``hit.chunks`` is then ``outs``' first ``num_chunks`` buffers).
        A chunk that cannot be read after all (its node died in between) ends the hit there.
        """
        self._begin_call()
        every_key = self.keys(token_ids, block_hashes=block_hashes, include_tail=include_tail)
        keys = self._limit(every_key, max_tokens)
        pin_id = uuid.uuid4().hex
        with self.client._cut_by_close():
            found = self.index.match(keys, pin_id=pin_id, lease_ms=self.pin_lease_ms).num_chunks
        matched = keys[:found]
        hit = PrefixHit(self, matched, [], pin_id, self.chunk_tokens)
        if not matched:
            return hit
        self._hold(hit)
        try:
            if outs is not None:
                dests = output_buffers(outs, found)
                if (
                    len(dests) == found - 1
                    and found == len(keys) == len(every_key)  # not cut by max_tokens: its last is the tail
                    and include_tail
                    and tail_tokens(token_ids, self.chunk_tokens)
                ):
                    # Buffers for the full chunks only, and another writer stored the tail: the
                    # full chunks are the hit (the tail's pin goes, under the renewal's lock).
                    with hit._pin_lock:
                        hit.keys = matched = matched[:-1]
                    self.index.unpin(keys[found - 1 : found], pin_id=pin_id)
                    found -= 1
                if len(dests) < found:
                    raise InvalidValue(f"{found} chunk(s) matched but {len(dests)} output buffer(s) given")
                with self._ops.active():
                    chunks: list[Any] = read_run(self.client, matched, dests[:found])
            else:
                with self._ops.active():
                    chunks = read_run(self.client, matched, None)
            usable = next((i for i, c in enumerate(chunks) if c is None), len(chunks))
            if usable < found:
                # The hit's keys shrink before the tail is unpinned, under the lock its renewal
                # takes: a renewal that read the whole list would pin the tail again afterwards,
                # ownerless for a lease.
                with hit._pin_lock:
                    hit.keys = matched[:usable]
                self.index.unpin(matched[usable:], pin_id=pin_id)
            hit.keys, hit.chunks, hit.num_chunks = matched[:usable], chunks[:usable], usable
            hit.num_tokens = self._tokens_of(token_ids, block_hashes, usable, len(keys))
            if usable == 0:
                hit.release()
        except BaseException:
            hit.release()
            raise
        return hit

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        where = redact_url(self.client.redis_url)
        return f"<PrefixCache {where} namespace={self.namespace!r} chunk_tokens={self.chunk_tokens}{state}>"

    def load_async(self, token_ids: Any = None, **kwargs: Any) -> Future[PrefixHit]:
        """:meth:`load` on a worker thread. The token ids, the block hashes and the list of
        ``outs`` are taken as they are now (a list reused by the caller at once matched another
        prompt, or none, or filled the next request's buffers); the buffers themselves are written
        until the future is done, after the caller's stream on device ones (as get_into_async)."""
        token_ids = tokens_as_now(token_ids)
        if "block_hashes" in kwargs:
            kwargs["block_hashes"] = snapshot(kwargs["block_hashes"])
        if "outs" in kwargs:
            kwargs["outs"] = outs_as_now(kwargs["outs"])
        return self._submit("load", self.load, token_ids, **kwargs)

    def store_async(self, token_ids: Any = None, chunks: Chunks = (), **kwargs: Any) -> Future[int]:
        """:meth:`store` on a worker thread (a pool of its own, apart from load_async's), so that
        an engine's request does not wait for the writes (nor, with the cluster's room pinned by
        other requests' hits, for that room: a store of large chunks took seconds then). The token
        ids, the block hashes and the list of chunks are taken as they are now; the chunks'
        buffers themselves, a stacked array's rows included, are read until the future is done,
        after the caller's stream on device ones (as put_async), so they must not be written
        before. A callable ``chunks(i)`` is called on the worker: what it returns must be ready
        then (a device array's writes done) and stay so until the future is done. Its result is
        the count :meth:`store` returns, and its errors are raised by it; arguments that cannot
        be taken (token ids that cannot be read) are refused at the call."""
        token_ids = tokens_as_now(token_ids)
        if "block_hashes" in kwargs:
            kwargs["block_hashes"] = snapshot(kwargs["block_hashes"])
        # As for a load's outs: the list as it is now, each device buffer's stream waited for here.
        return self._submit("store", self.store, token_ids, outs_as_now(chunks), **kwargs)

    def _submit(self, kind: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        # Before the lock too: in a forked child one a parent thread held at the fork stays held.
        self._check_open()
        with self._lock:  # close() sets _closed under it: no submit to a pool shut down meanwhile
            self._check_open()
            pool = self._pools.get(kind)
            if pool is None:
                pool = self._pools[kind] = ThreadPoolExecutor(
                    max_workers=self._io_threads, thread_name_prefix=f"mc-prefix-{kind}"
                )
            return pool.submit(call, *args, **kwargs)

    def _on_worker(self) -> bool:
        """Whether the calling thread is a worker of this cache's pools (a future's callback)."""
        return any(on_pool_thread(pool) for pool in list(self._pools.values()))

    # ---- pins -------------------------------------------------------------------------------
    def refcounts(
        self,
        token_ids: Any = None,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
        include_tail: bool = True,
    ) -> list[int]:
        """Live pins on each chunk of the prompt, one entry per chunk in chain order (0 where
        missing): every full chunk, then the partial last one when the token ids leave one (the
        tail, keyed by its own tokens: ``keys(..., include_tail=True)``), as load() matches them
        by default. Without the tail, a pin leaked on it (a load that stored the tail, or a hit
        cut back by its buffers) did not show. ``include_tail=False`` asks of the full chunks
        only; block hashes name full chunks only. Asked of a closed cache too (what its close
        left pinned), not of a closed client."""
        keys = self.keys(token_ids, block_hashes=block_hashes, include_tail=include_tail)
        with self.client._cut_by_close():
            return self.index.refcounts(keys)

    def _hold(self, hit: PrefixHit) -> None:
        hit._on_drop = self._dropped.watch(hit)
        with self._lock:
            self._held[hit.pin_id] = hit
            self._start_renewer()

    def _hold_claims(self, claims: Claims) -> None:
        with self._lock:
            self._claims[claims.writer_id] = claims
            self._start_renewer()

    def _release_claims(self, claims: Claims) -> None:
        with self._lock:
            self._claims.pop(claims.writer_id, None)
        try:
            claims.release()
        except MooncakeError as exc:
            # The store's own outcome is what its caller must see; the claims run out by their ttl.
            log.info("claims of %d chunk(s) not released (they expire): %s", len(claims.keys), exc)

    def _start_renewer(self) -> None:
        """Under ``_lock``: the thread that renews held hits' pins and stores' claims."""
        if self._renewer is None:
            # Through a weak reference: a thread on a bound method kept its cache alive, so a cache
            # dropped without close() was never collected and its thread ran until the client closed.
            interval_s = min(self.pin_lease_ms, self.claim_ttl_ms) / 3000
            self._renewer = threading.Thread(
                target=renew_while_alive,
                args=(weakref.ref(self), self._dropped, self._stop, interval_s),
                name="mc-prefix-renew",
                daemon=True,
            )
            self._renewer.start()

    def _release(self, hit: PrefixHit, *, unpin: bool = True) -> bool:
        """Forget ``hit`` and, with ``unpin``, unpin its chunks; False when the index was out of
        reach (a ConnectError: lost, or silent past timeout_s)."""
        if hit._on_drop is not None:
            hit._on_drop.detach()
        with self._lock:
            self._held.pop(hit.pin_id, None)
        # Even after close(): a load that raced it pinned its chunks, and the client is still open.
        if hit.keys and unpin:
            try:
                self.index.unpin(hit.keys, pin_id=hit.pin_id)
            except ConnectError:
                return False  # the index is unreachable: the pins run out by their lease
            except MooncakeError:
                pass  # refused (the client closed meanwhile): the pins run out by their lease
        return True

    def _renew_once(self) -> None:
        """One renewal, in a frame of its own: the loop's locals held the hits of the last tick
        while it waited for the next, and a hit dropped then was never collected, its pins renewed
        for good (prefix_pins.py unpins a hit once it is collected)."""
        self._dropped.unpin()
        with self._lock:
            hits = [h for h in self._held.values() if not h.released]
            stores = list(self._claims.values())
        for c in stores:
            self._renew(c, c.lock, c.renew)
        for h in hits:
            # The keys are read under the hit's lock, in the renewal: load() may have cut them.
            self._renew(h, h._pin_lock, partial(self._pin_held, h))

    def _pin_held(self, hit: PrefixHit) -> None:
        self.index.pin(hit.keys, pin_id=hit.pin_id, lease_ms=self.pin_lease_ms)

    @staticmethod
    def _renew(owner: Claims | PrefixHit, lock: threading.Lock, renew: Callable[[], object]) -> None:
        """``renew()`` under the owner's lock, unless it was released since the list was taken (a
        renewal then would pin or claim again what its owner let go)."""
        with lock:
            if owner.released:
                return
            try:
                renew()
            except MooncakeError:
                pass  # Redis unreachable: pins and claims run out by their lease or ttl, as a dead client's do

    # ---- life cycle -------------------------------------------------------------------------
    def _begin_call(self) -> None:
        """A match, store or load begins: refused once closed; hits dropped unreleased are unpinned
        first (prefix_pins.py; a round trip, so not under ``_lock`` as load_async's check is)."""
        self._check_open()
        self._dropped.unpin()

    def _sleep_open(self, seconds: float) -> None:
        """A store's wait between polls, cut short by close() (the cache's or its client's)."""
        self._stop.wait(seconds)
        self._check_open()

    def _check_open(self) -> None:
        if self._closed:
            raise MooncakeError("PrefixCache is closed")
        # Its index calls go to the client's connections: once the client is closed they would
        # fail as a ConnectError, which reads as a network fault worth retrying.
        self.client._check_open()

    def close(self) -> None:
        """Release every hit still held and stop the worker threads (the client stays open).
        Loads and stores under way in other threads end at once with MooncakeError("PrefixCache
        is closed"), even those waiting on a stalled agent: their connections are shut down.

        In a forked child it only marks the cache closed: the hits, pins, connections and puts
        are the parent's, which goes on using them."""
        if os.getpid() != self.client._pid:
            # Before any lock: a parent thread that held one at the fork left it held here.
            self._closed = True
            return
        with self._lock:
            closing_elsewhere = self._closed
            self._closed = True  # under the lock load_async checks it under
            hits = list(self._held.values())
        if closing_elsewhere:
            # As Client.close(): a second caller returns when the first has, but not on a worker
            # of the cache's pool (a future's callback), which the first may be waiting for.
            if not self._on_worker():
                self._closed_all.wait()
            return
        try:
            self._close_once(hits)
        finally:
            self._closed_all.set()

    def _close_once(self, hits: list[PrefixHit]) -> None:
        # Before the wait for the pool, which would otherwise last as long as a stalled transfer.
        self._ops.cancel()
        # A store past its transfers is committing: it ends before close() returns, and none
        # starts after (client/in_flight.py).
        self.client._in_flight.drain(self.client.config.timeout_s, cancel=self._ops)
        # Once the index is out of reach, the other hits are only marked released and the dropped
        # hits' pins are left: they run out by their lease, as DroppedHits.unpin leaves them after
        # its first failure. An unpin each made close() wait out timeout_s once per hit held.
        reachable = True
        for hit in hits:
            reachable = hit._let_go(unpin=reachable) and reachable
        if reachable:
            self._dropped.unpin(every=True)
        self._stop.set()
        on_worker = self._on_worker()
        for pool in list(self._pools.values()):
            pool.shutdown(wait=not on_worker)
        if self._renewer is not None:
            self._renewer.join(timeout=5)

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
