"""A replicas=2 put_many whose first replicas all go to one full node and whose second replicas
spread over every other node: the writer asked that node for room once, naming the nodes of every
object's other replica (the union), so every peer was spared and the node evicted cold objects
while both other nodes had room for them. The writer now asks once per group of objects whose
other replicas are on the same nodes, each with its own marks, and the room for each group is
spilled to the peers that group does not use."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from helpers import wait_until

from mooncake_store import Client, LocalCluster

MiB = 1 << 20


def node_tier(client: Client, node_id: str) -> tuple[int, int]:
    """The host tier's spills_out and evictions of ``node_id``, as its last heartbeat published them."""
    tier = next(n.tiers[0] for n in client.stat().nodes if n.node_id == node_id)
    return tier.spills_out, tier.evictions


def test_a_batch_whose_second_replicas_spread_over_every_peer_spills_its_room_and_evicts_nothing(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0)
    marks = ["--high-watermark", "0.99", "--low-watermark", "0.9"]  # no drain before the put asks
    cluster.add_agent(node_id="bs-full", extra_args=["--host-bytes", str(16 * MiB), *marks])
    cluster.add_agent(node_id="bs-roomy-1", extra_args=["--host-bytes", str(32 * MiB), *marks])
    cluster.add_agent(node_id="bs-roomy-2", extra_args=["--host-bytes", str(32 * MiB), *marks])
    client = make_client(cluster, timeout_s=20)
    cold = {f"cold/{i}": np.full(MiB, i, np.uint8) for i in range(15)}  # 15 MiB of 16, one copy each
    for key, value in cold.items():
        client.put(key, value, preferred_node="bs-full")
    # 4 MiB more on the full node; the second copies go where the batch spreads them (the
    # projected room of the two others, equal at first).
    hot = {f"hot/{i}": np.arange(2 * MiB, dtype=np.uint8) + i for i in range(2)}
    client.put_many(hot, replicas=2, preferred_node="bs-full")
    seconds = set()
    for key in hot:
        (listing,) = client.index.list_keys(key)
        holders = {r.node_id for r in listing.replicas}
        assert "bs-full" in holders and len(holders) == 2, listing
        seconds |= holders - {"bs-full"}
    assert seconds == {"bs-roomy-1", "bs-roomy-2"}, seconds  # the case: every peer holds a second copy
    assert client.stat().evictions == 0  # the index's count: objects whose last copy went
    # The agents' counters come with their heartbeats: the room was made by spills.
    assert wait_until(lambda: node_tier(client, "bs-full")[0] > 0, 10), client.stat().nodes
    assert node_tier(client, "bs-full")[1] == 0, client.stat().nodes
    assert client.stat().evictions == 0
    for key, value in {**hot, **cold}.items():
        assert np.array_equal(client.get(key), value), key
