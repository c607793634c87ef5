"""Evictions of a pressure pass go to the index in one round trip (evict.lua takes a batch, each
entry on its own and in order): a pass of small objects used to pay one round trip per object."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from helpers import wait_until

from mooncake_store import connect
from mooncake_store.agent.node import Agent

KiB = 1 << 10
MiB = 1 << 20


def test_a_batch_is_taken_in_order_so_a_leaf_lets_its_parent_go(make_inproc_agent: Callable[..., Agent]) -> None:
    agent = make_inproc_agent(host_bytes=4 * MiB)
    client = connect(agent.index.url, namespace=agent.namespace)
    try:
        value = np.zeros(1024, np.uint8)
        for parent, child in (("p1", "c1"), ("p2", "c2")):
            client.put_many({parent: value}, chain_pos={parent: 0})
            client.put_many({child: value}, chain_pos={child: 1}, chain_parent={child: parent})
        ids = {k: client.object_meta(k).replicas[0].alloc_id for k in ("p1", "c1", "p2", "c2")}  # type: ignore[union-attr]
        index = agent.index
        # Parent first: its child still hangs off it when its turn comes.
        assert index.evict_many([("p1", ids["p1"]), ("c1", ids["c1"])], node_id=agent.node_id) == ["PARENT", "OK"]
        # Leaf first: the parent is a leaf by its turn, in the same call.
        assert index.evict_many([("c2", ids["c2"]), ("p2", ids["p2"])], node_id=agent.node_id) == ["OK", "OK"]
        # An entry evicted already, and one that was never there.
        assert index.evict_many([("c2", ids["c2"]), ("nope", 1)], node_id=agent.node_id) == ["GONE", "GONE"]
        assert [k for k in ids if client.exists(k)] == ["p1"]
        assert index.evict_many([], node_id=agent.node_id) == []
    finally:
        client.close()


def test_a_pressure_pass_evicts_its_victims_in_one_round_trip(make_inproc_agent: Callable[..., Agent]) -> None:
    agent = make_inproc_agent(
        host_bytes=4 * MiB, high_watermark=0.5, low_watermark=0.25, pressure_interval_s=0.05, reserve_timeout_s=30.0
    )
    calls: list[int] = []
    evict_many = agent.index.evict_many

    def counting(victims: Any, **kwargs: Any) -> list[str]:
        calls.append(len(victims))
        return evict_many(victims, **kwargs)

    agent.index.evict_many = counting  # type: ignore[method-assign]
    client = connect(agent.index.url, namespace=agent.namespace)
    try:
        values = {f"k{i}": np.full(32 * KiB, i, np.uint8) for i in range(96)}  # 3 MiB: past 2 MiB
        for key, value in values.items():
            client.put(key, value)
        assert wait_until(lambda: agent.table.usage()[0] <= 0.5 * 4 * MiB, 10), "the agent did not get under its mark"

        def evicted() -> int:
            return sum(agent.pressure.counters[t]["evictions"] for t in agent.pressure.counters)

        def kept() -> list[str]:
            return [key for key in values if client.exists(key)]

        # A pass may still be under way when the tier gets under its mark: its objects leave the
        # index before its counter moves. Settled, every object gone is an eviction counted once.
        assert wait_until(lambda: evicted() == 96 - len(kept()), 10), (evicted(), len(kept()))
        assert evicted() >= 32
        # The pass that found the node past its high watermark evicted down to the low one (32
        # objects at least) in one call; later passes pick up what puts added meanwhile.
        assert max(calls) >= 16, f"index calls per pass: {calls} for {evicted()} evictions"
        assert sum(calls) >= evicted()
        for key in kept():  # what stayed is whole
            assert np.array_equal(client.get(key), values[key])
    finally:
        client.close()
