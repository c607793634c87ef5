"""An index client keeps the connections its scripts ran on (RedisIndex._run). When the index
server restarts, every kept connection is dead at once; a call that met one retried on the next
kept one, as dead, and failed: after a restart a client that had run scripts from several
threads failed about half its next calls with "lost the connection to Redis" while the server
was up and answering. The first broken connection now drops every kept one, and the retry runs
on a connection the pool has just checked."""

from __future__ import annotations

import threading

import pytest

from mooncake_store.embedded import EmbeddedServer
from mooncake_store.index.client import RedisIndex

THREADS = 6
CALLS_PER_THREAD = 40


def _run_from_threads(index: RedisIndex) -> None:
    """Run lookups from several threads at once, so the client keeps several connections."""
    start = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            start.wait(timeout=10)
            for _ in range(CALLS_PER_THREAD):
                index.lookup(["absent"], lease_ms=1000, counted=False)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []


@pytest.mark.parametrize("call", ["lookup", "remove"], ids=["replay-safe", "with-token"])
def test_calls_after_the_index_restarts_do_not_fail_on_the_connections_kept_before(call: str) -> None:
    server = EmbeddedServer().start()
    try:
        index = RedisIndex(server.url, namespace="kept-conns", timeout_s=5.0)
        try:
            rounds = 0
            while rounds < 5 and len(index._script_conns) < 3:  # threads overlap within a few rounds
                _run_from_threads(index)
                rounds += 1
            kept = len(index._script_conns)
            assert kept >= 3, f"the client kept {kept} connections after {rounds} rounds of threads"
            port = server.port
            server.stop()
            server = EmbeddedServer(port=port).start()
            failures = []
            for i in range(2 * kept):
                try:
                    if call == "lookup":
                        index.lookup([f"k{i}"], lease_ms=1000, counted=False)
                    else:
                        assert index.remove([f"k{i}"]) == [0]
                except Exception as exc:  # counted: the assert below names the first
                    failures.append(repr(exc))
            assert failures == [], f"{len(failures)} of {2 * kept} calls failed after the restart: {failures[0]}"
        finally:
            index.close()
    finally:
        server.stop()
