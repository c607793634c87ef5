"""RedisIndex's reads that are no script: the listing of keys with their records (`mooncake ls`,
the bench's clean-up) and the counts that stat() shows. They read the index as it is, in a pipeline, and
change nothing."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from mooncake_store.errors import ConnectError, MooncakeError, ProtocolError
from mooncake_store.index.key_glob import glob_matcher, server_pattern
from mooncake_store.index.schema import decode_object
from mooncake_store.types import Replica, check_pattern


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyListing:
    key: str
    size_bytes: int
    dtype: str
    shape: tuple[int, ...]
    replicas: tuple[Replica, ...]
    created_ms: int
    last_access_ms: int


class ListingCalls:
    """RedisIndex's listing and counts."""

    redis: redis.Redis
    prefix: str
    #: The URL as messages show it (password redacted).
    where: str

    def list_keys(self, pattern: str = "*", *, limit: int = 10_000) -> list[KeyListing]:
        """The first ``limit`` keys matching ``pattern`` in key order, with their metadata. Every
        matching name is read (the index keeps them in a set, in no order), and only ``limit`` of
        them are held at once."""
        check_pattern(pattern)
        # Matched by character here: the server's MATCH takes bytes (index/key_glob.py).
        matches = glob_matcher(pattern)
        try:
            names = self.redis.sscan_iter(self.prefix + "keys", match=server_pattern(pattern), count=1000)
            keys = sorted(first_in_order((name for name in names if matches(name)), limit))
            return self._listings(keys)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise ConnectError(f"cannot list the keys in Redis at {self.where}: {exc}") from None
        except redis.RedisError as exc:  # reached, and refused (ACL, out of memory, ...): no connection error
            raise MooncakeError(f"Redis at {self.where} refused listing the keys: {exc}") from None
        except UnicodeDecodeError as exc:  # the connection decodes replies (see _run)
            raise ProtocolError(
                f"a key name or record in namespace {self.prefix!r} at {self.where} is bytes that are no UTF-8 "
                f"({exc}): written by hand or by another build"
            ) from None

    def _listings(self, keys: list[str]) -> list[KeyListing]:
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(
                self.prefix + "o:" + key,
                "size",
                "dtype",
                "shape",
                "checksum",
                "version",
                "replicas",
                "created",
                "last_access",
            )
        out = []
        for key, fields in zip(keys, pipe.execute(), strict=True):
            if fields[0] is None:
                continue  # removed between the scan and the read
            meta = decode_object(key, fields)
            out.append(
                KeyListing(
                    key=key,
                    size_bytes=meta.size_bytes,
                    dtype=meta.dtype,
                    shape=meta.shape,
                    replicas=meta.replicas,
                    created_ms=_record_int(fields[6], f"o:{key} created"),
                    last_access_ms=_record_int(fields[7], f"o:{key} last_access"),
                )
            )
        return out

    def counts(self, node_ids: Sequence[str]) -> tuple[int, dict[str, int], dict[str, int]]:
        """(objects in the namespace, objects per node, stats counters) in one round trip. The
        counters hold "short" too: the objects listed for re-replication on these nodes (short of
        the replicas they were stored with since a node's loss, their copies not yet made)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.scard(self.prefix + "keys")
        for node in node_ids:
            pipe.scard(self.prefix + "nobj:" + node)
            pipe.scard(self.prefix + "repair:" + node)
        pipe.hgetall(self.prefix + "stats")
        try:
            raw = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise ConnectError(f"cannot read the counts from Redis at {self.where}: {exc}") from None
        except redis.RedisError as exc:
            raise MooncakeError(f"Redis at {self.where} refused reading the counts: {exc}") from None
        per_node = {node: int(n) for node, n in zip(node_ids, raw[1:-1:2], strict=True)}
        stats = {k: _record_int(v, f"stats {k}") for k, v in raw[-1].items()}
        stats["short"] = sum(int(n) for n in raw[2:-1:2])
        return int(raw[0]), per_node, stats


class _Largest:
    """A name ordered backwards, so that heapq's smallest is the largest name kept."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __lt__(self, other: _Largest) -> bool:
        return self.name > other.name


def first_in_order(names: Iterable[str], limit: int) -> list[str]:
    """The ``limit`` smallest distinct names of ``names`` (a SCAN may yield a name twice), holding
    no more than that many at once."""
    heap: list[_Largest] = []
    kept: set[str] = set()
    for name in names:
        if name in kept:
            continue
        if len(heap) < limit:
            heapq.heappush(heap, _Largest(name))
            kept.add(name)
        elif heap and name < heap[0].name:
            kept.discard(heapq.heapreplace(heap, _Largest(name)).name)
            kept.add(name)
    return [entry.name for entry in heap]


def _record_int(value: str | None, where: str) -> int:
    """An integer field of an index record (0 when absent); ProtocolError naming the field when
    it is no integer (written by hand, or by another build): a bare ValueError reached `mooncake
    ls` and stat() as an internal error."""
    try:
        return int(value or 0)
    except ValueError:
        raise ProtocolError(f"malformed index record: {where}={value!r:.60} is no integer") from None
