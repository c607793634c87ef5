"""Index operations of the prefix cache: chain match, pins and write claims, one round trip each.

Adds two kinds of keys to the layout of :mod:`mooncake_store.index.schema`::

    mc:{ns}:pins:<key>     zset   pin id -> expiry ms (the one remove.lua and put_commit.lua honour)
    mc:{ns}:claim:<key>    string writer id, with a TTL: one writer stores a missing chunk

and keeps the ``refcount`` field of an object record equal to its live pins as of the last pin or
unpin. The scripts run with ``prelude.lua`` and ``prefix_prelude.lua`` in front, so they judge a
replica readable by exactly the rule of ``lookup.lua`` (COMPLETE, on a node within its heartbeat
deadline).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_store.errors import InvalidValue, MooncakeError
from mooncake_store.index.client import RedisIndex
from mooncake_store.index.schema import in_batches
from mooncake_store.index.scripts import build_script, read_script

SCRIPT_NAMES = (
    "prefix_match",
    "prefix_pin",
    "prefix_unpin",
    "prefix_refcount",
    "prefix_claim",
    "prefix_release",
)
#: Longest chain one match call takes: 65,536 chunks of 256 tokens are 16M tokens. A call over
#: that many keys would hold the server for tens of milliseconds.
MAX_CHAIN_CHUNKS = 65_536


@dataclass(frozen=True, slots=True, kw_only=True)
class MatchResult:
    now_ms: int
    num_chunks: int


class PrefixIndex:
    """Prefix operations on the namespace of ``index``; shares its Redis connection pool."""

    def __init__(self, index: RedisIndex) -> None:
        self.index = index
        self.prefix = index.prefix
        preludes = (read_script("prelude"), read_script("prefix_prelude"))
        self._scripts = {n: build_script(index.redis, *preludes, read_script(n)) for n in SCRIPT_NAMES}

    def _run(self, name: str, *args: Any) -> Any:
        # The index's own fast path: a kept connection and a cached sha (see RedisIndex._run).
        return self.index._run(name, *args, scripts=self._scripts)

    def match(self, keys: Sequence[str], *, pin_id: str = "", lease_ms: int = 0) -> MatchResult:
        """How many leading ``keys`` are readable; with ``lease_ms > 0`` they are pinned as ``pin_id``.
        One round trip per BATCH_LIMIT chunks (a million tokens of 256-token chunks): one script
        call walking a whole 65,536-chunk chain held the server for everyone else; the next window
        is asked only while the last one matched whole. Keys hold no control characters
        (:func:`mooncake_store.types.check_key`), so they travel joined by newlines."""
        # A longer chain is matched up to the limit (store() takes any length; a load of it
        # should get what can be matched, not an error).
        keys = keys[:MAX_CHAIN_CHUNKS]
        if any("\n" in k for k in keys):
            raise InvalidValue("chain keys must not contain newlines")
        if lease_ms > 0 and not pin_id:
            raise InvalidValue("pinning needs a pin id")
        if not keys:
            return MatchResult(now_ms=self.index.server_time_ms(), num_chunks=0)
        first_now: int | None = None
        total = 0
        asked = 0  # keys sent so far, the failed window's included
        try:
            for window in in_batches(keys):
                asked += len(window)
                now, count = self._run("prefix_match", int(lease_ms), pin_id, "\n".join(window))
                first_now = int(now) if first_now is None else first_now
                total += int(count)
                if int(count) < len(window):
                    break
        except MooncakeError:
            # A window failed: the earlier ones' pins would otherwise outlive the call by their
            # whole lease, keeping those chunks from eviction with no hit to release them; and so
            # would the failed window's, should its script have run with its reply lost (a
            # timeout). Unpinning a key this pin id does not hold changes nothing.
            if asked and lease_ms > 0:
                with contextlib.suppress(MooncakeError):  # unreachable: they run out by their lease
                    self.unpin(keys[:asked], pin_id=pin_id)
            raise
        assert first_now is not None
        return MatchResult(now_ms=first_now, num_chunks=total)

    def pin(self, keys: Sequence[str], *, pin_id: str, lease_ms: int) -> list[bool]:
        """Pin (or renew) ``keys`` until now + ``lease_ms``; False where the object is gone."""
        if lease_ms <= 0:
            raise InvalidValue(f"pin lease must be > 0 ms, got {lease_ms}")
        return [bool(x) for batch in in_batches(keys) for x in self._run("prefix_pin", pin_id, int(lease_ms), *batch)]

    def unpin(self, keys: Sequence[str], *, pin_id: str) -> int:
        return sum(int(self._run("prefix_unpin", pin_id, *batch)) for batch in in_batches(keys))

    def refcounts(self, keys: Sequence[str]) -> list[int]:
        return [int(x) for batch in in_batches(keys) for x in self._run("prefix_refcount", *batch)]

    def claim(self, keys: Sequence[str], *, writer_id: str, ttl_ms: int) -> list[str]:
        """'HAVE', 'MINE' or 'BUSY' per key (see prefix_claim.lua)."""
        return [str(x) for batch in in_batches(keys) for x in self._run("prefix_claim", writer_id, int(ttl_ms), *batch)]

    def release(self, keys: Sequence[str], *, writer_id: str) -> int:
        return sum(int(self._run("prefix_release", writer_id, *batch)) for batch in in_batches(keys))
