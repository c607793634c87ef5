"""A writer putting in a loop spreads its puts over the nodes (client/placed.py): ranked by the
node table alone, whose rows are a heartbeat old, 60 puts of replicas=2 on three nodes all went to
the same two, which passed their high watermarks and spilled to and fro while the third stayed
nearly empty; a probe of node deaths then lost objects that had been put with two copies."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from mooncake_store import Client, LocalCluster

KiB = 1 << 10


def test_puts_in_a_loop_spread_over_the_nodes_as_a_batch_does(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(3, host_bytes=16 << 20)
    client = make_client(cluster)
    client.stat()  # every agent in the table before the first put
    placed: Counter[str] = Counter()
    for i in range(30):  # 15 MiB of copies on 48 MiB: no node nears its high watermark
        key = f"spread/{i}"
        client.put(key, np.full(256 * KiB, i, np.uint8), replicas=2)
        meta = client.object_meta(key)  # where the put placed it, before any pass could move it
        assert meta is not None and len({r.node_id for r in meta.replicas}) == 2
        placed.update(r.node_id for r in meta.replicas)
    assert sorted(placed) == sorted(a.node_id for a in cluster.agents), placed
    assert min(placed.values()) >= 15, placed  # 20 each when even; all 30 on two nodes before
    for node in client.stat().nodes:  # nothing had to move
        assert node.tiers[0].spills_out == 0 and node.tiers[0].evictions == 0, node
