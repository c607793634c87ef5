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
from helpers import refused_agent, wait_until

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
    if probe:
        time.sleep(1.0)  # the pressure pass a refusal wakes runs within milliseconds: none came
        assert client.exists("old") and client.stat().evictions == 0
    else:  # waited for, not slept on: on a loaded machine that pass may take longer than a second
        assert wait_until(lambda: client.stat().evictions == 1, 10), client.stat()
        assert not client.exists("old")


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


def test_a_first_choice_that_cannot_make_room_hands_the_put_to_a_node_that_can(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Only the first choice was asked to make room, attempt after attempt: with its objects all
    pinned (a node full of held prefix hits), the put waited out timeout_s, though another node
    could have evicted for it (second diff review of the probes)."""
    cluster = make_cluster(2, host_bytes=MiB)
    client = make_client(cluster, timeout_s=10.0)
    a, b = (agent.node_id for agent in cluster.agents)
    index = client.index
    for i in range(3):
        client.put(f"a{i}", np.full(290 * KiB, i, np.uint8), preferred_node=a)
        index.redis.zadd(index.prefix + f"pins:a{i}", {"held": index.server_time_ms() + 120_000})
        client.put(f"b{i}", np.full(290 * KiB, i, np.uint8), preferred_node=b)
    started = time.monotonic()
    client.put("new", np.full(200 * KiB, 7, np.uint8))
    assert time.monotonic() - started < 5.0
    assert client.object_meta("new").replicas[0].node_id == b  # type: ignore[union-attr]
    assert all(client.exists(f"a{i}") for i in range(3))  # pinned: kept


def test_a_batch_into_a_full_cluster_gets_room_for_all_of_its_objects(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """Room was asked for one homeless object per attempt (the agent keeps the largest request,
    not the sum): six objects of 150 KiB into two full 1 MiB agents waited out timeout_s."""
    cluster = make_cluster(2, host_bytes=MiB)
    client = make_client(cluster, timeout_s=3.0)
    for i in range(20):
        client.put(f"f{i}", np.full(90 * KiB, i, np.uint8))
    batch = {f"n{i}": np.full(150 * KiB, i, np.uint8) for i in range(6)}
    client.put_many(batch)
    assert all(np.array_equal(client.get(key), value) for key, value in batch.items())


def test_a_put_whose_first_choice_takes_a_while_to_make_room_costs_one_nodes_room(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """One more node was asked to make room at each wait, the first after 50 ms: where the first
    choice's pass had hundreds of small objects to evict, the put made room on both nodes, and
    one of them evicted for nothing (second diff review). Now one more each second."""
    cluster = make_cluster(2, host_bytes=16 * MiB)
    client = make_client(cluster, timeout_s=10.0)
    for i in range(2 * 16 * 1024 // 16):
        client.put(f"f{i}", np.full(16 * KiB, i % 256, np.uint8))
    time.sleep(1.5)  # the fill's own pressure passes are over
    before = {node.node_id: node.objects for node in client.stat().nodes}
    client.put("big", np.full(12 * MiB, 7, np.uint8))
    holder = client.object_meta("big").replicas[0].node_id  # type: ignore[union-attr]
    other = next(node for node in before if node != holder)
    after = {node.node_id: node.objects for node in client.stat().nodes}
    assert after[other] >= before[other] - 8, (before, after)  # the other node kept its objects
