"""A copy of a replicated object that a full node's pass dropped is listed for repair, and copied
back only into room under a peer's low watermark (a replica-durability probe of 2026-12-07): the
drop listed nothing, so `stat` said short 0 while the object had one copy (the README's rolling
restart waits for 0), and the next node's loss took the object, with the cluster 57% full. Copied
back into room under a high watermark instead, as a node's loss is, the copy would go to the next
node to fill, whose next pass would drop it again."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

KiB = 1 << 10
CHUNK = 256 * KiB  # 16 of them fill a 4 MiB host tier: high watermark 3.6 MiB, low 3 MiB


def _fill(client: Client, prefix: str, count: int, node: str) -> list[str]:
    keys = [f"{prefix}{i}" for i in range(count)]
    for i, key in enumerate(keys):
        client.put(key, np.full(CHUNK, i, np.uint8), preferred_node=node)
    return keys


def _nodes(client: Client, key: str) -> set[str]:
    meta = client.object_meta(key)
    return {r.node_id for r in meta.replicas} if meta is not None else set()


def test_a_dropped_copy_counts_short_and_goes_back_only_under_a_low_watermark(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    pressed = direct_agent(namespace, node_id="n0-pressed", spill_to_peers=True)
    holder = direct_agent(namespace, node_id="n1-holder", spill_to_peers=True)
    third = direct_agent(namespace, node_id="n2-third", spill_to_peers=True)
    client = client_of(namespace)
    third_fill = _fill(client, "fill", 14, third.node_id)  # 3.5 MiB: between its marks, no room for more
    third.heartbeat_once()
    replicated = [f"rep{i}" for i in range(4)]
    for i, key in enumerate(replicated):
        client.put(key, np.full(CHUNK, 100 + i, np.uint8), replicas=2, preferred_node=pressed.node_id)
        assert _nodes(client, key) == {pressed.node_id, holder.node_id}
    _fill(client, "held", 10, holder.node_id)  # 3.5 MiB on the holder too: it takes no spill either
    _fill(client, "warm", 11, pressed.node_id)  # 3.75 MiB on the pressed node: past its 3.6 MiB mark
    for agent in (pressed, holder, third):
        agent.sync_once()
        agent.heartbeat_once()

    # Nowhere to spill (the holder holds them, and both peers would pass their marks): the pass
    # drops the coldest, the replicated objects' copies (their objects stay readable).
    assert pressed.pressure.relieve_host() > 0
    assert pressed.pressure.counters[TierKind.HOST]["evictions"] == 3
    dropped = [key for key in replicated if _nodes(client, key) == {holder.node_id}]
    assert len(dropped) == 3
    assert client.stat().short == 3  # it said 0: a rolling restart went on, and lost them
    pressed.heartbeat_once()

    # The pressed node is at its low watermark and the third between its marks: neither takes a
    # dropped copy back (the pressed node would drop it again at its next pass).
    assert holder.pressure.repairs.run_once(set()) == 0
    assert client.stat().short == 3

    # Room under the third's low watermark: the copies go there.
    for key in third_fill[:8]:
        client.remove(key)
    third.sync_once()  # the removed objects' memory comes back (no read lease held it)
    third.heartbeat_once()
    assert holder.pressure.repairs.run_once(set()) == 3
    assert client.stat().short == 0
    for key in dropped:
        assert _nodes(client, key) == {holder.node_id, third.node_id}
    for i, key in enumerate(replicated):
        assert np.array_equal(client.get(key), np.full(CHUNK, 100 + i, np.uint8))
