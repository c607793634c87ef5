"""Byte-exact round trips through real agents, over shm and over tcp, from a client process that
is not the agents' process."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster

SIZES = [0, 1, 4 << 10, 1 << 20, 64 << 20]
DTYPES = [np.uint8, np.float16, np.float32, np.int64]


def _value(size_bytes: int, dtype: type, seed: int) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    count = size_bytes // itemsize
    raw = np.random.default_rng(seed).integers(0, 256, count * itemsize, dtype=np.uint8)
    array = raw.view(dtype)
    if count % 4 == 0 and count >= 4:
        array = array.reshape(4, count // 4)  # a shape to restore, not just a length
    return array


@pytest.fixture(scope="module")
def big_cluster(redis_server: object) -> LocalCluster:
    with LocalCluster(2, redis_url=redis_server.url, host_bytes=160 << 20) as cluster:  # type: ignore[attr-defined]
        yield cluster  # type: ignore[misc]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("size", SIZES)
def test_round_trip(
    big_cluster: LocalCluster, make_client: Callable[..., Client], transport: str, dtype: type, size: int
) -> None:
    client = make_client(big_cluster, transports=(transport,), lease_ms=300)
    value = _value(size, dtype, seed=size + np.dtype(dtype).itemsize)
    key = f"rt/{transport}/{np.dtype(dtype).name}/{size}"
    client.put(key, value)
    got = client.get(key)
    assert got.dtype == value.dtype
    assert got.shape == value.shape
    assert got.tobytes() == value.tobytes()
    out = np.empty(value.nbytes, dtype=np.uint8)
    assert client.get_into(key, out) == value.nbytes
    assert out.tobytes() == value.tobytes()
    assert client.remove(key)
    assert not client.exists(key)


def test_buffer_kinds_round_trip(client: Client) -> None:
    payloads: dict[str, object] = {
        "bytes": b"hello world",
        "bytearray": bytearray(b"\x00\x01\x02" * 1000),
        "memoryview": memoryview(np.arange(100, dtype=np.int32)),
        "2d": np.arange(12, dtype=np.float64).reshape(3, 4),
        "bool": np.array([True, False, True]),
    }
    client.put_many(payloads)
    got = client.get_many([*payloads, "missing"])
    assert got[-1] is None
    assert got[0].tobytes() == b"hello world"
    assert got[1].tobytes() == bytes(payloads["bytearray"])  # type: ignore[arg-type]
    assert got[2].dtype == np.int32 and got[2].tolist() == list(range(100))
    assert got[3].shape == (3, 4) and got[3].dtype == np.float64
    assert got[4].dtype == np.bool_ and got[4].tolist() == [True, False, True]


def test_torch_tensor_round_trip(client: Client) -> None:
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        tensor = torch.arange(64, dtype=torch.float32).reshape(8, 8).to(dtype)
        client.put(f"torch/{dtype}", tensor)
        got = client.get(f"torch/{dtype}")
        back = got if isinstance(got, torch.Tensor) else torch.from_numpy(got)
        assert back.dtype == dtype and torch.equal(back, tensor)
        out = torch.empty_like(tensor)
        client.get_into(f"torch/{dtype}", out)
        assert torch.equal(out, tensor)


def test_replace_is_visible_and_old_space_is_freed(cluster: LocalCluster, make_client: Callable[..., Client]) -> None:
    client = make_client(cluster, lease_ms=200)
    for round_ in range(20):
        client.put("same", np.full(1 << 20, round_, dtype=np.uint8))
        assert int(client.get("same")[0]) == round_
    # 20 MiB were written into 2x64 MiB arenas: the replaced copies went back to the allocators.
    client.remove("same")
    deadline_s = 10.0
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if client.stat().used_bytes == 0:
            break
        time.sleep(0.2)
    assert client.stat().used_bytes == 0


def test_batch_round_trip_and_async(client: Client) -> None:
    items = {f"batch/{i}": np.full(1000 + i, i % 251, dtype=np.uint8) for i in range(200)}
    client.put_many(items)
    outs = [np.empty(len(v), dtype=np.uint8) for v in items.values()]
    sizes = client.get_many_into(list(items), outs)
    assert sizes == [len(v) for v in items.values()]
    for out, value in zip(outs, items.values(), strict=True):
        assert np.array_equal(out, value)
    futures = [client.get_async(k) for k in list(items)[:20]]
    for fut, value in zip(futures, list(items.values())[:20], strict=True):
        assert np.array_equal(fut.result(timeout=30), value)
    client.put_async("async/put", b"xyz").result(timeout=30)
    assert client.get("async/put").tobytes() == b"xyz"


def test_stat_reports_nodes_and_objects(client: Client) -> None:
    client.put("s1", np.zeros(1 << 20, np.uint8))
    client.put("s2", np.zeros(1 << 20, np.uint8), replicas=2)
    stats = client.stat()
    assert [n.node_id for n in stats.live_nodes] == ["agent-0", "agent-1"]
    assert stats.objects == 2
    assert sum(n.objects for n in stats.nodes) == 3  # s2 has a replica on each node
    assert stats.capacity_bytes == 2 * (64 << 20)
    assert all(n.tiers[0].tier == "host" for n in stats.nodes)
    assert stats.as_dict()["nodes"][0]["node_id"] == "agent-0"


def test_local_cluster_as_the_readme_shows_it() -> None:
    """The issue's surface word for word: a private cluster, then connect(cluster.redis_url)."""
    from mooncake_store import connect

    with LocalCluster(num_agents=2, host_bytes=32 << 20) as cluster:
        client = connect(cluster.redis_url)
        try:
            client.put("k", np.arange(10, dtype=np.int64).reshape(2, 5), replicas=1)
            arr = client.get("k")
            assert arr.shape == (2, 5) and arr.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
            assert [n.node_id for n in client.stat().live_nodes] == ["agent-0", "agent-1"]
        finally:
            client.close()
