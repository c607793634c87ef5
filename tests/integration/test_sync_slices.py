"""An agent's sync takes expired reservations to the index a bounded slice at a time: all of them
went in one script call, which blocks the index while it runs (200,000 at once held every other
client 0.35 s; a million ran past the call's timeout, and every sync sent the same set again).

A real in-process agent with the session's real Redis; its reservations are made in its own table
(as RESERVE frames would) and left to expire."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from mooncake_store.agent import syncing
from mooncake_store.agent.node import Agent


def test_expired_reservations_go_to_the_index_a_slice_per_sync(make_inproc_agent: Callable[..., Agent]) -> None:
    agent = make_inproc_agent(host_bytes=16 << 20, reserve_timeout_s=0.2)
    count = syncing.MAX_EXPIRED_PER_SYNC + 1000
    reserved = agent.table.reserve([(64, i.to_bytes(16, "little")) for i in range(count)])
    assert reserved is not None and len(agent.table.reserved_deadlines()) == count
    time.sleep(0.3)  # all expired now, none of them committed
    agent.sync_once()
    assert len(agent.table.reserved_deadlines()) == 1000  # the rest wait for the next sync
    agent.sync_once()
    assert agent.table.reserved_deadlines() == {}
    assert agent.table.usage()[0] == 0  # all of their room is back


def test_refused_reservations_wait_for_the_sync_under_way_rather_than_queue_their_own(
    make_inproc_agent: Callable[..., Agent],
) -> None:
    """A refused RESERVE reclaims first: one sync on the connection thread. With the index slow,
    each refused RESERVE queued a sync of its own behind the one holding the lock, each a round
    trip: the k-th waited k of them, past its client's timeout. Now one that finds a sync under way
    waits for that one's end, which freed what is due as well."""
    agent = make_inproc_agent()
    real_sync = agent.index.agent_sync
    calls: list[float] = []

    def slow_sync(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        time.sleep(0.5)
        return real_sync(*args, **kwargs)

    agent.index.agent_sync = slow_sync  # type: ignore[method-assign]
    threads = []
    for _ in range(5):  # refused reservations 30 ms apart, each past the reclaims' rate limit
        threads.append(threading.Thread(target=agent.reclaim_now))
        threads[-1].start()
        time.sleep(0.03)
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert 1 <= len(calls) <= 2, f"{len(calls)} syncs for 5 reclaims while one was under way"
