"""Pressure, from a walk through the README (session 30): a writer's first choice, refused, made
room for it even when the writer then went to another node. Three puts of 600 KiB on two 1 MiB
agents evicted two objects, not one: the put of s2 was refused on agent-0 (which evicted s0),
then on agent-1 (which spilled s1 into the room agent-0 had made), and on its next try agent-0
refused it again and evicted s1 while agent-1, now empty, took s2. A writer with other nodes to try
now asks as a probe (RESERVE flag 2), which makes no room; only once no node takes the object is
its first choice asked to make room."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import refused_agent

from mooncake_store import Client, LocalCluster
from mooncake_store.errors import NoCapacity
from mooncake_store.transport import frames
from mooncake_store.transport.tcp import PeerConnections

KiB, MiB = 1 << 10, 1 << 20


def _value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, 600 * KiB, dtype=np.uint8)


def test_one_put_into_a_full_cluster_evicts_one_object_not_one_per_node_it_asked(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, host_bytes=MiB)
    client = make_client(cluster, timeout_s=5.0)
    for i in range(3):
        client.put(f"s{i}", _value(i))
    time.sleep(1.0)  # passes that would follow (the second eviction came within ~60 ms)
    stored = {key: client.object_meta(key) for key in ("s0", "s1", "s2")}
    assert sum(meta is None for meta in stored.values()) == 1, stored  # room for two, one went
    assert stored["s2"] is not None  # the last written
    for key, meta in stored.items():
        if meta is not None:
            assert np.array_equal(client.get(key), _value(int(key[1])))
    assert client.stat().evictions == 1
    assert {meta.replicas[0].node_id for meta in stored.values() if meta} == {a.node_id for a in cluster.agents}


@pytest.mark.parametrize("probe", [True, False])
def test_a_refused_probe_makes_no_room_and_a_refused_reserve_does(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], probe: bool
) -> None:
    cluster = make_cluster(1, host_bytes=MiB)
    client = make_client(cluster)
    client.put("old", _value(0))
    agent = cluster.agents[0]
    peer = PeerConnections(agent.endpoint, timeout_s=5, max_idle=1)
    try:
        with pytest.raises(NoCapacity, match=f"need {600 * KiB} B"):
            peer.reserve([(600 * KiB, b"w" * 16)], node_id=agent.node_id, flags=frames.PROBE_FLAG if probe else 0)
    finally:
        peer.close()
    time.sleep(1.0)  # the pressure pass a refusal wakes runs within milliseconds
    assert client.exists("old") == probe
    assert client.stat().evictions == (0 if probe else 1)


def test_a_batch_no_layout_could_hold_fails_at_once_naming_the_limit(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, host_bytes=MiB)
    client = make_client(cluster, timeout_s=10.0)
    started = time.monotonic()
    with pytest.raises(NoCapacity, match="hold at most 2 of the 3 objects it needs together") as caught:
        client.put_many({f"b{i}": _value(i) for i in range(3)})
    assert caught.value.permanent and time.monotonic() - started < 5.0  # it waited out timeout_s
    assert not any(client.exists(f"b{i}") for i in range(3))
    client.put_many({f"b{i}": _value(i) for i in range(2)})  # what fits is stored as before


def test_an_agent_given_another_agents_disk_directory_exits_2(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """It exited 1, as for a failure, where a --listen port in use exits 2 (README walk-through)."""
    disks = tmp_path / "disks"
    cluster = make_cluster(0)
    cluster.add_agent(node_id="d1", extra_args=["--disk", str(disks), "--disk-mem", "4MiB"])
    status, err = refused_agent(
        "--redis-url", cluster.redis_url, "--namespace", cluster.namespace, "--node-id", "d1",
        "--host-bytes", "4MiB", "--no-prefault", "--disk", str(disks), "--disk-mem", "4MiB",
    )  # fmt: skip
    assert status == 2, err
    assert f"the disk tier directory {disks / 'd1'} is in use by another agent" in err, err
