"""Calls racing close() in other threads (review, twenty-eighth session): each ends with the
store's own error, never one from inside redis-py."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from mooncake_store import ConnectError, LocalCluster, MooncakeError, connect

pytestmark = pytest.mark.timeout(120)


def test_index_calls_racing_its_close_fail_as_connect_errors(shared_cluster: LocalCluster) -> None:
    """RedisIndex.close() disconnected the connections other threads were using: redis-py found
    their sockets gone mid-call and raised TypeError ("argument must be an int, or have a fileno()
    method") or AttributeError ("'NoneType' object has no attribute 'sendall'"), ~1 call in 300 of
    a stress run. Now their sockets are shut down, and the calls fail as ConnectError."""
    seen: Counter[str] = Counter()
    rounds_left, deadline = 60, time.monotonic() + 40
    while rounds_left and time.monotonic() < deadline:
        rounds_left -= 1
        client = connect(shared_cluster.redis_url, namespace=shared_cluster.namespace)
        index = client.index
        go = threading.Event()

        def call(i: int, index=index, go=go) -> None:  # type: ignore[no-untyped-def]
            go.wait()
            for _ in range(10_000):  # ends at the first error: close() comes within 0.15 s
                try:
                    if i % 3 == 0:
                        index.nodes()
                    elif i % 3 == 1:
                        index.server_time_ms()
                    else:
                        index.lookup(["absent"], lease_ms=0)
                except ConnectError:
                    seen["ConnectError"] += 1
                    return
                except Exception as exc:  # what the test looks for
                    seen[f"{type(exc).__name__}: {exc}"] += 1
                    return

        threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        go.set()
        time.sleep(0.02 + random.random() * 0.13)
        index.close()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        try:
            client.close()
        except MooncakeError:
            pass
    assert seen["ConnectError"] > 0
    assert set(seen) == {"ConnectError"}, seen
