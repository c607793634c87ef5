"""PrefixCache.load_async takes the list of its outs as it is at the call, as the other *_async
calls take the lists that hold their arguments (README)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from mooncake_store import Client, LocalCluster, PrefixCache


def test_prefix_load_async_takes_the_list_of_outs_as_it_is_at_the_call(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The worker read the caller's list when it ran: a caller that refilled its list for its next
    request at once had this request's chunks written into the next request's buffers."""
    client = make_client(make_cluster(1))
    cache = PrefixCache(client, "async-outs/u8/L1/kv1/d8/tp0", chunk_tokens=4, io_threads=1)
    try:
        tokens = list(range(12))
        cache.store(tokens, [np.full(16, i + 1, np.uint8) for i in range(3)])
        release = threading.Event()

        def held_outs(n: int) -> list[bytearray]:
            release.wait(30)  # holds the cache's only worker: what is submitted next runs later
            return [bytearray(16) for _ in range(n)]

        blocker = cache.load_async(tokens, outs=held_outs)
        mine = [bytearray(16) for _ in range(3)]
        outs = list(mine)
        future = cache.load_async(tokens, outs=outs)
        following = [bytearray(16) for _ in range(3)]
        outs[:] = following  # the caller's list, refilled for its next request at once
        release.set()
        blocker.result(30).release()
        with future.result(30) as hit:
            assert hit.num_chunks == 3
            assert [bytes(b) for b in mine] == [bytes([i + 1]) * 16 for i in range(3)]
            assert all(bytes(b) == bytes(16) for b in following)
    finally:
        cache.close()
