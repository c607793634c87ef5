"""Concurrent calls that need a fresh node table while the index is stalled: each queued on the
node view's lock and, once the read ahead of it failed at timeout_s, made a round trip of its own,
so the k-th of k calls ended after k x timeout_s and close() waited for the last. A call that
waited behind a failed read now gets that read's error at once."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import Future
from typing import Any

import pytest
from helpers import stop_process

from mooncake_store import LocalCluster, connect
from mooncake_store.client import node_view
from mooncake_store.errors import ConnectError

CALLS = 4


def test_calls_queued_behind_a_failed_table_read_share_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_view, "NODE_TABLE_TTL_S", 0.0)  # every put reads the table
    with LocalCluster(1, host_bytes=8 << 20) as cluster:
        assert cluster.server is not None
        with connect(cluster.redis_url, namespace=cluster.namespace, timeout_s=2.0, io_threads=CALLS) as client:
            client.put("warm", b"x" * 64)
            # Counts the table reads (each begins with the index's time), and passes each on.
            reads: list[int] = []
            count_lock = threading.Lock()
            server_time_ms = client.index.server_time_ms

            def counted() -> int:
                with count_lock:
                    reads.append(1)
                return server_time_ms()

            monkeypatch.setattr(client.index, "server_time_ms", counted)
            stop_process(cluster.server.pid)
            try:
                futures: list[Future[Any]] = [client.put_async(f"k{i}", b"y" * 64) for i in range(CALLS)]
                errors = []
                for future in futures:
                    with pytest.raises(ConnectError) as info:
                        future.result(timeout=120)
                    errors.append(str(info.value))
            finally:
                os.kill(cluster.server.pid, signal.SIGCONT)
            # One round trip waited out for all of them (each used to make its own, one after another).
            assert len(reads) == 1, errors
            assert len(set(errors)) == 1 and "cannot read the server time" in errors[0], errors
            client.put("after", b"z" * 64)  # the next call reads the table afresh
            assert bytes(client.get("after")) == b"z" * 64
