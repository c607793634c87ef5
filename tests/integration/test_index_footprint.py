"""DESIGN.md §2 and §3.1, checked on the server itself: the index holds metadata only (never an
object's bytes), and every key of a namespace sits under its hash-tagged prefix ``mc:{ns}:``."""

from __future__ import annotations

import re
import uuid

import numpy as np
import redis

from mooncake_store import LocalCluster, PrefixCache, connect
from mooncake_store.embedded import EmbeddedServer
from mooncake_store.index import schema

MiB = 1 << 20


def _namespace_keys(server: redis.Redis, namespace: str) -> list[bytes]:
    return [k for k in server.scan_iter(count=1000) if b"{" + namespace.encode() + b"}" in k]


def _documented_kinds() -> set[str]:
    """The key kinds schema.py's layout names: ``o`` for ``mc:{ns}:o:<key>``, ``keys``, ..."""
    return set(re.findall(r"^\s+mc:\{ns\}:([a-z_]+)", schema.__doc__ or "", re.M))


def test_the_index_holds_metadata_only_and_every_key_under_its_namespace_tag(redis_server: EmbeddedServer) -> None:
    namespace = f"fp-{uuid.uuid4().hex[:8]}"
    server = redis_server.client()
    before = set(server.scan_iter(count=1000))
    with (
        LocalCluster(2, redis_url=redis_server.url, namespace=namespace, host_bytes=32 * MiB),
        connect(redis_server.url, namespace=namespace) as client,
    ):
        value = np.random.default_rng(1).integers(0, 255, 4 * MiB, dtype=np.uint8)
        client.put("big", value)
        client.put("big", value)  # replaced: a grave, then freed
        client.put("copied", value[: 1 * MiB], replicas=2)
        with PrefixCache(client, "fp/u8/L1/kv1/d8/tp0", chunk_tokens=4) as cache:
            tokens = list(range(12))
            cache.store(tokens, [np.full(1024, i, np.uint8) for i in range(3)])
            with cache.load(tokens) as hit:
                assert hit.num_chunks == 3
        client.remove("copied")
        new = set(server.scan_iter(count=1000)) - before
        # Other tests' agents share this server: their keys are under their own tags.
        untagged = sorted(k for k in new if not k.startswith(b"mc:{"))
        assert not untagged, f"keys under no namespace tag: {untagged[:5]}"
        mine = set(_namespace_keys(server, namespace))
        assert mine, "the namespace wrote no keys at all"
        stray = sorted(k for k in mine if not k.startswith(f"mc:{{{namespace}}}:".encode()))
        assert not stray, f"keys naming the namespace outside mc:{{{namespace}}}: {stray[:5]}"
        # Every kind of key is in the layout (it lacked two, one per put and remove of the last 10 s).
        prefix = f"mc:{{{namespace}}}:".encode()
        kinds = {k[len(prefix) :].split(b":")[0].decode() for k in mine}
        assert kinds <= _documented_kinds(), f"undocumented key kinds: {kinds - _documented_kinds()}"
        used = sum(server.memory_usage(k) or 0 for k in mine)
        # A few records per object and node: far below the 5 MiB of bytes stored (one copy of
        # them would be 4 MiB in one key).
        assert used < 256 * 1024, f"the namespace holds {used} B in Redis for 5 MiB of objects"
        largest = max(mine, key=lambda k: server.memory_usage(k) or 0)
        assert (server.memory_usage(largest) or 0) < 64 * 1024, largest
