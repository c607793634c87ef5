"""An agent's sync takes expired reservations to the index a bounded slice at a time: all of them
went in one script call, which blocks the index while it runs (200,000 at once held every other
client 0.35 s; a million ran past the call's timeout, and every sync sent the same set again).

A real in-process agent with the session's real Redis; its reservations are made in its own table
(as RESERVE frames would) and left to expire."""

from __future__ import annotations

import time
from collections.abc import Callable

from mooncake_store.agent import node as agent_node
from mooncake_store.agent.node import Agent


def test_expired_reservations_go_to_the_index_a_slice_per_sync(make_inproc_agent: Callable[..., Agent]) -> None:
    agent = make_inproc_agent(host_bytes=16 << 20, reserve_timeout_s=0.2)
    count = agent_node.MAX_EXPIRED_PER_SYNC + 1000
    reserved = agent.table.reserve([(64, i.to_bytes(16, "little")) for i in range(count)])
    assert reserved is not None and len(agent.table.reserved_deadlines()) == count
    time.sleep(0.3)  # all expired now, none of them committed
    agent.sync_once()
    assert len(agent.table.reserved_deadlines()) == 1000  # the rest wait for the next sync
    agent.sync_once()
    assert agent.table.reserved_deadlines() == {}
    assert agent.table.usage()[0] == 0  # all of their room is back
