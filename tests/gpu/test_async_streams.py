"""put_async and get_into_async of device arrays: the caller's stream is waited for in the caller's
thread. Asked from the io worker, a torch tensor or cupy array names the worker's current stream,
and work the caller queued on a side stream would go unwaited for."""

from __future__ import annotations

from typing import Any

import numpy as np

from mooncake_store import Client, LocalCluster

MiB = 1 << 20
#: Matrix products queued on the side stream before the late write: far longer than a put or get.
PRODUCTS = 20


def late_fill_on_a_side_stream(torch: Any, tensor: Any, value: int) -> Any:
    """A torch side stream (pool streams do not wait for the default stream) with PRODUCTS matrix
    products queued, then ``tensor.fill_(value)`` behind them; returned to be made current."""
    side = torch.cuda.Stream()
    a = torch.zeros((8192, 8192), device=tensor.device)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(PRODUCTS):
            a = a @ a
        tensor.fill_(value)
    return side


def test_put_async_waits_for_the_callers_side_stream(cuda_torch, gpu_cluster: LocalCluster, make_client) -> None:  # type: ignore[no-untyped-def]
    torch = cuda_torch
    client: Client = make_client(gpu_cluster)
    source = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda:0")
    side = late_fill_on_a_side_stream(torch, source, 7)
    with torch.cuda.stream(side):
        future = client.put_async("side-written", source)
    future.result(timeout=60)
    assert np.array_equal(client.get("side-written"), np.full(4 * MiB, 7, np.uint8))


def test_get_into_async_waits_for_the_callers_side_stream(cuda_torch, gpu_cluster: LocalCluster, make_client) -> None:  # type: ignore[no-untyped-def]
    """The destination is still being written on the caller's side stream: the read lands after."""
    torch = cuda_torch
    client: Client = make_client(gpu_cluster)
    value = np.random.default_rng(3).integers(0, 256, 4 * MiB, dtype=np.uint8)
    client.put("to-read", value)
    out = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda:0")
    side = late_fill_on_a_side_stream(torch, out, 9)
    with torch.cuda.stream(side):
        future = client.get_into_async("to-read", out)
    assert future.result(timeout=60) == 4 * MiB
    torch.cuda.synchronize()
    assert np.array_equal(out.cpu().numpy(), value)
