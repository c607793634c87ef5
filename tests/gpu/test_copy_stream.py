"""Copies run on a non-blocking stream of the calling thread's own: a loader thread pulls objects
into its own stream's buffers while work queued on the legacy default stream (a forward pass) is
still running, and neither waits for the other."""

from __future__ import annotations

import threading

import numpy as np

from mooncake_store import Client, LocalCluster
from mooncake_store.tiers.gpu_arrays import copy_stream

MiB = 1 << 20
#: cudaStreamNonBlocking
NON_BLOCKING = 1
#: Queued matrix products on the default stream: ~20 ms each on an H200, far longer than the loads.
PRODUCTS = 20


def test_each_thread_copies_on_its_own_non_blocking_stream(cupy) -> None:  # type: ignore[no-untyped-def]
    mine = copy_stream(cupy)
    assert mine == copy_stream(cupy) and mine not in (0, 1, 2)  # not a default stream
    assert cupy.cuda.runtime.streamGetFlags(mine) == NON_BLOCKING
    other: list[int] = []
    worker = threading.Thread(target=lambda: other.append(copy_stream(cupy)))
    worker.start()
    worker.join(timeout=30)
    assert other and other[0] != mine


def test_a_loader_thread_reads_while_the_default_stream_is_busy(  # type: ignore[no-untyped-def]
    cupy, gpu_cluster: LocalCluster, make_client
) -> None:
    client: Client = make_client(gpu_cluster)
    host_value = np.random.default_rng(11).integers(0, 256, 8 * MiB, dtype=np.uint8)
    gpu_value = np.random.default_rng(12).integers(0, 256, 4 * MiB, dtype=np.uint8)
    client.put("chunk/host", host_value)
    client.put("chunk/gpu", cupy.asarray(gpu_value))
    assert str(client.object_meta("chunk/gpu").replicas[0].tier) == "gpu"  # type: ignore[union-attr]
    a = cupy.zeros((8192, 8192), dtype=cupy.float32)  # a memset: no kernel to compile
    sizes = {"chunk/host": 8 * MiB, "chunk/gpu": 4 * MiB}
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        outs = {key: cupy.zeros(n, dtype=cupy.uint8) for key, n in sizes.items()}
        for key, out in outs.items():  # warm-up: pins the agent's arena, opens its IPC handle
            client.get_into(key, out)
        for out in outs.values():
            out.fill(0)
    cupy.cuda.runtime.deviceSynchronize()
    results: dict[str, object] = {}

    def loader() -> None:
        with stream:
            for key, out in outs.items():
                client.get_into(key, out)
            results["compute_done_after_loads"] = compute_done.done
            results["bytes"] = {key: cupy.asnumpy(out) for key, out in outs.items()}

    for _ in range(PRODUCTS):  # queued on the legacy default stream, not waited for
        a = a @ a
    compute_done = cupy.cuda.Event()
    compute_done.record(cupy.cuda.Stream.null)
    worker = threading.Thread(target=loader)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    # The loads did not wait for the queued products: on the legacy stream they would have.
    assert results["compute_done_after_loads"] is False
    got = results["bytes"]
    assert np.array_equal(got["chunk/host"], host_value)  # type: ignore[index]
    assert np.array_equal(got["chunk/gpu"], gpu_value)  # type: ignore[index]
    compute_done.synchronize()
