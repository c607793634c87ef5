"""Calls racing close() in other threads (review, twenty-eighth session): each ends with the
store's own error, never one from inside redis-py."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

import pytest
import redis
from helpers import wait_until

from mooncake_store import ConnectError, LocalCluster, MooncakeError, connect
from mooncake_store.index import RedisIndex

pytestmark = pytest.mark.timeout(120)


def race_close(
    index: RedisIndex, calls: list[Callable[[RedisIndex], object]], *, threads: int, within_s: float
) -> Counter[str]:
    """``threads`` threads call ``calls[i % len(calls)]`` on ``index`` until one fails, and the
    index is closed within ``within_s``: what ended each thread (ConnectError, or "Type: message")."""
    seen: Counter[str] = Counter()
    go = threading.Event()

    def call(i: int) -> None:
        go.wait()
        for _ in range(10_000):  # ends at the first error: the close comes first
            try:
                calls[i % len(calls)](index)
            except ConnectError:
                seen["ConnectError"] += 1
                return
            except Exception as exc:  # what the tests look for
                seen[f"{type(exc).__name__}: {exc}"] += 1
                return

    workers = [threading.Thread(target=call, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    go.set()
    time.sleep(0.01 + random.random() * within_s)
    index.close()
    for t in workers:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in workers)
    return seen


def test_index_calls_racing_its_close_fail_as_connect_errors(shared_cluster: LocalCluster) -> None:
    """RedisIndex.close() disconnected the connections other threads were using: redis-py found
    their sockets gone mid-call and raised TypeError ("argument must be an int, or have a fileno()
    method") or AttributeError ("'NoneType' object has no attribute 'sendall'"), ~1 call in 300 of
    a stress run. Now their sockets are shut down, and the calls fail as ConnectError."""
    seen: Counter[str] = Counter()
    calls = [RedisIndex.nodes, RedisIndex.server_time_ms, lambda index: index.lookup(["absent"], lease_ms=0)]
    rounds_left, deadline = 60, time.monotonic() + 40
    while rounds_left and time.monotonic() < deadline:
        rounds_left -= 1
        client = connect(shared_cluster.redis_url, namespace=shared_cluster.namespace)
        seen += race_close(client.index, calls, threads=12, within_s=0.14)
        with contextlib.suppress(MooncakeError):
            client.close()
    assert seen["ConnectError"] > 0
    assert set(seen) == {"ConnectError"}, seen


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def test_connections_cut_by_a_close_are_closed_when_their_calls_hand_them_back(redis_url: str) -> None:
    """The sockets a close shut down under calls racing it went back to the old pool open, one
    descriptor each, until a cyclic garbage collection (22 over 30 closes)."""
    calls = [RedisIndex.server_time_ms, lambda index: index.lookup(["absent"], lease_ms=0)]
    gc.collect()
    gc.disable()  # what is left open must not depend on when a collection happens to run
    try:
        before = _sockets()
        for _ in range(20):
            race_close(RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}"), calls, threads=8, within_s=0.04)
        assert _sockets() - before <= 2, f"{_sockets() - before} sockets left open by 20 closes"
    finally:
        gc.enable()


def test_a_forked_childs_close_does_not_cut_its_parents_calls(redis_url: str) -> None:
    """The child's RedisIndex.close() shut down the sockets of the calls its parent had under way
    at the fork (the same sockets): a parent's BLPOP failed with a connection error."""
    index = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    admin = redis.Redis.from_url(redis_url)
    waiting_on = f"waited-on-{uuid.uuid4().hex[:8]}"
    result: list[object] = []

    def blpop() -> None:
        try:
            result.append(index.redis.blpop([waiting_on], timeout=30))
        except Exception as exc:  # what the test looks for
            result.append(exc)

    def blocked() -> bool:
        """The server holds a BLPOP blocked: this test's (no product code blocks on a list)."""
        return any(c.get("cmd") == "blpop" and "b" in c.get("flags", "") for c in admin.client_list())

    waiter = threading.Thread(target=blpop)
    waiter.start()
    try:
        # Not a sleep: forked before the BLPOP is under way, the child shares no socket of a call
        # and its close cuts nothing; a loaded machine may start the thread late.
        assert wait_until(blocked, 10), "the BLPOP never got under way"
        pid = os.fork()
        if pid == 0:  # the child: close its copy, and leave at once
            try:
                index.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        # Ended by an element pushed only after the child's close, well inside its timeout: the
        # BLPOP was under way across the close, and a cut one would have failed instead.
        admin.rpush(waiting_on, b"x")
        waiter.join(timeout=10)
        assert result == [(waiting_on, "x")], result  # the index decodes answers
    finally:
        admin.delete(waiting_on)
        admin.close()
        index.close()
        waiter.join(timeout=10)
