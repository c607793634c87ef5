"""Puts with replicas=N on a cluster whose nodes differ in size (review, thirty-third session):
a refusal names the object's size and what the nodes left out hold, and no put is stored with a
copy that the node holding it evicts at its next pressure pass."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster, NoCapacity

KiB, MiB = 1 << 10, 1 << 20


def small_and_big(make_cluster: Callable[..., LocalCluster], *, bigs: int = 1) -> LocalCluster:
    cluster = make_cluster(0)
    cluster.add_agent(node_id="small", extra_args=["--host-bytes", str(MiB)])
    for i in range(bigs):
        cluster.add_agent(node_id=f"big{i}", extra_args=["--host-bytes", str(4 * MiB)])
    return cluster


def test_a_replicas_refusal_names_the_size_and_the_limit(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """An object larger than one node's whole arena, replicas=2 on two nodes: the refusal said
    only that one node "qualified", not the object's size nor what the other node can hold."""
    client = make_client(small_and_big(make_cluster), timeout_s=3.0)
    size = MiB + 64 * KiB
    with pytest.raises(NoCapacity) as info:
        client.put("f", np.zeros(size, np.uint8), replicas=2)
    message = str(info.value)
    assert info.value.permanent
    assert str(size) in message and f"small {int(0.9 * MiB) // 64 * 64} B" in message, message
    assert client.object_meta("f") is None


def test_a_replicas_2_put_is_refused_when_one_node_alone_keeps_it(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """An object over small's high watermark by itself (0.94 of 1 MiB) but kept by big0, with
    replicas=2: it was stored on both, and small's next pressure pass evicted its copy (big0,
    which holds the other, is no target), leaving one copy for good."""
    client = make_client(small_and_big(make_cluster), timeout_s=3.0)
    with pytest.raises(NoCapacity) as info:
        client.put("x", np.ones(960 * KiB, np.uint8), replicas=2)
    assert "replicas=2 needs 2 live nodes that keep" in str(info.value), info.value
    assert client.object_meta("x") is None


def test_a_replicas_2_put_goes_to_the_nodes_that_keep_it(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """With two nodes that keep it, both copies go there and both stay through pressure passes."""
    client = make_client(small_and_big(make_cluster, bigs=2), timeout_s=5.0)
    value = np.arange(960 * KiB, dtype=np.uint8)
    client.put("x", value, replicas=2)
    time.sleep(1.0)  # several pressure passes (0.2 s apart)
    meta = client.object_meta("x")
    assert meta is not None
    assert sorted(r.node_id for r in meta.replicas) == ["big0", "big1"], meta.replicas
    assert np.array_equal(client.get("x"), value)
