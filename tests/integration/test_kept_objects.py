"""An object that no tier of the cluster keeps under its high watermark is refused by put, not
stored and then evicted by the first pressure pass (a put that succeeded, then a get that misses)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mooncake_store import Client, KeyNotFound, LocalCluster, NoCapacity

MiB = 1 << 20


def payload(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size, dtype=np.uint8)


def settle() -> None:
    """Longer than an agent's pressure interval, so a pass has run on what was stored."""
    time.sleep(1.0)


def test_an_object_past_every_high_watermark_is_refused_and_one_below_is_kept(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0)
    cluster.add_agent(node_id="only", extra_args=["--host-bytes", str(16 * MiB)])  # high watermark 0.9
    client = make_client(cluster, timeout_s=5)
    with pytest.raises(NoCapacity) as info:
        client.put("too-big", payload(15 * MiB, 1))
    message = str(info.value)
    assert info.value.permanent
    kept = int(0.9 * 16 * MiB) // 64 * 64  # in whole 64 B units, as the arena counts an object
    assert str(15 * MiB) in message and str(kept) in message and "high watermark" in message
    assert not client.exists("too-big")
    with pytest.raises(KeyNotFound):
        client.get("too-big")

    for size in (kept + 1, kept + 64):  # the limit counts whole units: one byte past it is refused
        with pytest.raises(NoCapacity, match="more than any live node keeps"):
            client.put("just-over", payload(size, 6))
    at_limit = payload(kept, 2)
    client.put("kept", at_limit)
    settle()
    assert np.array_equal(client.get("kept"), at_limit)  # past a pressure pass: still there
    assert client.stat().evictions == 0


def test_a_node_that_does_not_keep_it_spills_it_to_one_that_does(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0)
    cluster.add_agent(node_id="small", extra_args=["--host-bytes", str(16 * MiB)])
    cluster.add_agent(node_id="large", extra_args=["--host-bytes", str(64 * MiB)])
    client = make_client(cluster, timeout_s=10)
    value = payload(15 * MiB, 3)
    client.put("big", value, preferred_node="small")  # kept by the cluster: small spills it to large
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        meta = client.object_meta("big")
        assert meta is not None, "the object was lost"
        if [r.node_id for r in meta.replicas] == ["large"]:
            break
        time.sleep(0.1)
    assert [r.node_id for r in meta.replicas] == ["large"]
    assert np.array_equal(client.get("big"), value)
    assert client.stat().evictions == 0


def test_a_disk_tier_keeps_what_its_memory_tier_can_hold(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    cluster = make_cluster(0)
    cluster.add_agent(
        node_id="with-disk",
        extra_args=["--host-bytes", str(16 * MiB), "--disk", str(tmp_path / "disk"), "--disk-mem", str(64 * MiB)],
    )
    client = make_client(cluster, timeout_s=10)
    value = payload(15 * MiB, 4)
    client.put("big", value)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        meta = client.object_meta("big")
        assert meta is not None, "the object was lost"
        if [str(r.tier) for r in meta.replicas] == ["disk"]:
            break
        time.sleep(0.1)
    assert np.array_equal(client.get("big"), value)
    assert client.stat().evictions == 0
    with pytest.raises(NoCapacity, match="the largest host arena is"):  # larger than memory: said so
        client.put("larger-than-memory", payload(17 * MiB, 5))
