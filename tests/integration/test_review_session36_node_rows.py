"""A node row whose endpoint is no HOST:PORT (written by hand or by another build; review,
thirty-sixth session) was taken into the node table and its endpoint parsed only when a put or a
read went there: a put whose first choice it was failed with that ProtocolError (or landed
there). It is now left out of the table, as other malformed rows are: puts go to the other
nodes, and reads to the other replicas."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, connect
from mooncake_store.agent.node import Agent


@pytest.mark.parametrize("endpoint", ["garbage", "127.0.0.1:0", "127.0.0.1:99999", "127.0.0.1:²", 12])
def test_a_node_row_with_a_bad_endpoint_is_left_out_and_the_read_goes_elsewhere(
    direct_agent: Callable[..., Agent], redis_url: str, namespace: str, endpoint: object
) -> None:
    a = direct_agent(namespace)
    b = direct_agent(namespace)
    client: Client = connect(redis_url, namespace=namespace, timeout_s=10.0, transports=("tcp",))
    try:
        value = np.random.default_rng(36).integers(0, 255, 64 << 10, dtype=np.uint8)
        client.put("both", value, replicas=2)
        rows = client.index.prefix + "nodes"
        # The replica the read takes first (the cheapest) is on a node whose row goes bad.
        first = client._gets._best_replica(client.object_meta("both"), client._node_table(refresh=True))
        assert first is not None
        bad = first[1].node_id
        record = json.loads(client.index.redis.hget(rows, bad))
        record["tcp_endpoint"] = endpoint
        client.index.redis.hset(rows, bad, json.dumps(record))
        assert bad not in client._node_table(refresh=True)
        assert np.array_equal(client.get("both"), value)
        other = a if bad == b.node_id else b
        assert other.node_id in client._node_table()
        # And puts go to the nodes whose rows are sound: each one failed with the bad row's
        # ProtocolError while its node was ranked first.
        for i in range(4):
            client.put(f"new-{i}", value)
            meta = client.object_meta(f"new-{i}")
            assert meta is not None and [r.node_id for r in meta.replicas] == [other.node_id]
    finally:
        client.close()
