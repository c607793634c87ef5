"""PrefixCache.close() with hits held and the index stalled (Redis stopped by SIGSTOP, by its
pid): each held hit's unpin waited out timeout_s in turn, so a cache closing with N hits held took
N x timeout_s. Now the first unpin that cannot reach the index ends the round trips: the other
hits are marked released, their pins left to run out by their lease (as DroppedHits.unpin does)."""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any

import numpy as np
from helpers import stop_process

from mooncake_store import LocalCluster, PrefixCache, connect
from mooncake_store.embedded import EmbeddedServer

HITS = 6


def test_close_with_held_hits_and_a_stalled_index_tries_one_unpin() -> None:
    server = EmbeddedServer().start()
    try:
        with (
            LocalCluster(1, redis_url=server.url, namespace=f"t-{uuid.uuid4().hex[:8]}", host_bytes=8 << 20) as cluster,
            connect(server.url, namespace=cluster.namespace, timeout_s=0.5) as client,
        ):
            cache = PrefixCache(client, "stall", chunk_tokens=4)
            prompts = [list(range(i * 100, i * 100 + 8)) for i in range(HITS)]
            for p in prompts:
                cache.store(p, [np.full(64, 1, dtype=np.uint8)] * 2)
            hits = [cache.load(p) for p in prompts]
            assert all(h.num_chunks == 2 for h in hits)
            unpins: list[str] = []
            real_unpin = cache.index.unpin

            def counted_unpin(keys: Any, **kwargs: Any) -> Any:  # passes every call on
                unpins.append(kwargs.get("pin_id", ""))
                return real_unpin(keys, **kwargs)

            cache.index.unpin = counted_unpin  # type: ignore[method-assign]
            stop_process(server.pid)
            try:
                cache.close()
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert all(h.released for h in hits)
            assert len(unpins) == 1, f"{len(unpins)} unpin round trips to a stalled index, each timeout_s"
    finally:
        server.stop()
