"""GPU-side checks of fixes that earlier sessions could test only without a device: the GPU arena's
lock once it is closed, a client's unmapping of a stopped agent's GPU arena (GpuSegments.retain),
TCP reads of GPU replicas queueing no promotion, and prefix chains cut back from their leaves when
the GPU tier itself must evict (thirty-first session)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from helpers import beat_since, random_bytes, wait_until

from mooncake_store import Client, LocalCluster, PrefixCache, TransferError
from mooncake_store.client.stats import TierStats
from mooncake_store.tiers.gpu import GpuArena, GpuSegment

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def test_a_closed_arena_refuses_copies_through_itself_and_its_segments() -> None:
    """A read racing an agent's stop() copied through a freed device pointer; each copy now holds
    the arena's lock and refuses once it is closed, also through a segment of the same process."""
    arena = GpuArena(0, 4 * MiB)
    seg = GpuSegment(0, arena.ipc_handle, arena.size_bytes)  # same process: the arena's own pointer
    data = random_bytes(MiB, 31)
    arena.write_from_host(0, memoryview(data))
    with seg.in_use():  # open: a copy may go ahead
        assert seg.pointer(0, MiB) == arena.base_ptr
    arena.close()
    back = np.zeros(MiB, np.uint8)
    with pytest.raises(TransferError, match="was closed"):
        arena.read_to_host(0, memoryview(back))
    with pytest.raises(TransferError, match="was closed"):
        arena.write_from_host(0, memoryview(data))
    with pytest.raises(TransferError, match="was closed"), seg.in_use():
        pass
    assert not back.any()  # nothing was copied
    seg.close()


def test_a_client_unmaps_a_stopped_agents_gpu_arena_and_maps_its_successors(  # type: ignore[no-untyped-def]
    cupy, make_cluster, make_client
) -> None:
    """Each IPC mapping keeps its agent's arena resident on the device: once the agent leaves the
    node table the client closes it, and a new agent's arena is mapped afresh."""
    cluster: LocalCluster = make_cluster(0)
    gpu_args = ["--host-bytes", str(16 * MiB), "--gpu-mem", str(16 * MiB)]
    first = cluster.add_agent(node_id="gpu-a", extra_args=gpu_args)
    client: Client = make_client(cluster, timeout_s=20)
    value = random_bytes(MiB, 32)
    client.put("a", cupy.asarray(value))
    assert str(client.object_meta("a").replicas[0].tier) == "gpu"  # type: ignore[union-attr]
    assert np.array_equal(cupy.asnumpy(client.get("a", device=0)), value)
    gpus = client._gpu
    assert gpus is not None and gpus.open_count() == 1
    first.stop()
    assert wait_until(lambda: "gpu-a" not in client._node_table(refresh=True), timeout_s=10)
    assert gpus.open_count() == 0  # the stopped agent's arena is no longer mapped here
    cluster.add_agent(node_id="gpu-b", extra_args=gpu_args)
    client._node_table(refresh=True)
    other = random_bytes(MiB, 33)
    client.put("b", cupy.asarray(other))
    assert str(client.object_meta("b").replicas[0].tier) == "gpu"  # type: ignore[union-attr]
    assert np.array_equal(cupy.asnumpy(client.get("b", device=0)), other)
    assert gpus.open_count() == 1


def test_tcp_reads_of_gpu_replicas_queue_no_promotion(  # type: ignore[no-untyped-def]
    cupy, make_cluster, make_client, tmp_path: Path
) -> None:
    """An agent serves a GPU replica over TCP through the same hook as a disk read; only disk reads
    may be offered to the promotion queue, which would otherwise move GPU objects to host memory."""
    cluster: LocalCluster = make_cluster(0)
    cluster.add_agent(
        node_id="gpu-0",
        extra_args=[
            "--host-bytes", str(16 * MiB), "--gpu-mem", str(16 * MiB),
            "--disk", str(tmp_path / "disk"), "--disk-mem", str(64 * MiB),
        ],
    )  # fmt: skip
    client: Client = make_client(cluster)
    values = {f"g/{i}": random_bytes(MiB, 40 + i) for i in range(4)}
    for key, value in values.items():
        client.put(key, cupy.asarray(value))
    tcp_only = make_client(cluster, transports=("tcp",))
    for _ in range(2):
        for key, value in values.items():
            assert np.array_equal(tcp_only.get(key), value), key
    started = time.monotonic()

    def tiers() -> dict[str, TierStats]:
        return {t.tier: t for t in client.stat().nodes[0].tiers}

    # The agent's counters reach the node table with its heartbeats: waited for, from a beat after
    # the reads; by then a promotion would have run too.
    assert wait_until(lambda: beat_since(client, started) and tiers()["gpu"].reads >= 2 * len(values), 10), tiers()
    time.sleep(0.5)  # and a little longer for a queued promotion, which must not come
    assert {str(client.object_meta(k).replicas[0].tier) for k in values} == {"gpu"}  # type: ignore[union-attr]
    now = tiers()
    assert now["host"].promotions == 0 and now["host"].objects == 0, now


def test_cold_chains_on_the_gpu_tier_are_cut_back_from_their_leaves(  # type: ignore[no-untyped-def]
    cupy, make_cluster, make_client
) -> None:
    """The GPU tier's own evictions cut cold chains back from their leaves, as the host tier's do:
    a hot prompt and the newest chains stay whole. Host memory is held near its high watermark by
    objects under a long read lease, so the GPU tier's victims have nowhere to go but out."""
    cluster: LocalCluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(4 * MiB), "--gpu-mem", str(12 * MiB)])
    client: Client = make_client(cluster, lease_ms=20, timeout_s=30)
    fill = {f"fill/{i}": random_bytes(256 << 10, 50 + i) for i in range(14)}  # 3.5 of 4 MiB
    for key, value in fill.items():
        client.put(key, value)
    holder: Client = make_client(cluster, lease_ms=120_000)
    for key, value in fill.items():
        assert np.array_equal(holder.get(key), value), key  # leased: no pass may move them
    cache = PrefixCache(client, "session31/f32/L1/kv1/d16/tp0/gpu", chunk_tokens=16)
    length = 9

    def chunk(i: int):  # type: ignore[no-untyped-def]
        """16 KiB of ``i``s on the device: the GPU tier holds ~750, more than a pass samples."""
        return cupy.full((2, 16, 128), i, dtype=cupy.float32)

    cold = [np.arange(length * 16) + 100_000 * (j + 1) for j in range(60)]
    for j, tokens in enumerate(cold):
        cache.store(tokens, [chunk(j)] * length)
    hot = np.arange(length * 16) + 77_000_000
    cache.store(hot, [chunk(999)] * length)
    with cache.load(hot) as hit:
        assert hit.num_chunks == length
    filler = [np.arange(length * 16) + 900_000_000 + 10_000 * j for j in range(20)]
    for j, tokens in enumerate(filler):
        cache.store(tokens, [chunk(5000 + j)] * length)

    def gpu_evictions() -> int:
        return sum(t.evictions for n in client.stat().nodes for t in n.tiers if t.tier == "gpu")

    assert wait_until(lambda: gpu_evictions() > 0, 15), client.stat()
    time.sleep(1.0)  # the drain's last passes
    assert cache.match(hot) == length * 16, "the hot prompt lost chunks"
    assert [cache.match(t) for t in filler] == [length * 16] * len(filler), "the newest chunks went"
    assert sum(cache.match(t) < length * 16 for t in cold) > 0  # what went instead
    with cache.load(hot) as hit:
        for got in hit.chunks:
            np.testing.assert_array_equal(got, np.full((2, 16, 128), 999, np.float32))
    for key, value in fill.items():
        assert np.array_equal(client.get(key), value), key
    cache.close()
