"""put_async and get_into_async of device arrays: the caller's stream is waited for in the caller's
thread. Asked from the io worker, a torch tensor or cupy array names the worker's current stream,
and work the caller queued on a side stream would go unwaited for."""

from __future__ import annotations

from typing import Any

import numpy as np

from mooncake_store import Client, LocalCluster, PrefixCache

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


def test_prefix_load_async_waits_for_the_callers_side_stream(
    cuda_torch, gpu_cluster: LocalCluster, make_client
) -> None:  # type: ignore[no-untyped-def]
    """load_async's device outs were asked for their stream on the worker only, which names its
    own: a write the caller queued on a side stream before the call landed after the load."""
    torch = cuda_torch
    client: Client = make_client(gpu_cluster)
    cache = PrefixCache(client, "async-streams/u8/L1/kv1/d8/tp0", chunk_tokens=4)
    try:
        tokens = list(range(8))
        cache.store(tokens, [np.full(4 * MiB, 5, np.uint8), np.full(4 * MiB, 6, np.uint8)])
        outs = [torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
        side = late_fill_on_a_side_stream(torch, outs[0], 9)
        with torch.cuda.stream(side):
            outs[1].fill_(9)
            future = cache.load_async(tokens, outs=outs)
        with future.result(timeout=60) as hit:
            assert hit.num_chunks == 2
        torch.cuda.synchronize()
        assert [int(o[0]) for o in outs] == [5, 6] and [int(o[-1]) for o in outs] == [5, 6]
    finally:
        cache.close()


def test_prefix_load_async_reads_cuda_token_ids_after_the_callers_side_stream(
    cuda_torch, gpu_cluster: LocalCluster, make_client
) -> None:  # type: ignore[no-untyped-def]
    """CUDA token ids were cloned on the caller's stream and copied to the host on the worker's:
    with the ids still being written on a side stream, the worker could hash what the clone had
    not filled yet (another prompt, or none). They are copied to the host in the caller's thread."""
    torch = cuda_torch
    client: Client = make_client(gpu_cluster)
    cache = PrefixCache(client, "async-streams-ids/u8/L1/kv1/d8/tp0", chunk_tokens=4)
    try:
        cache.store(list(range(8)), [np.full(64, 1, np.uint8), np.full(64, 2, np.uint8)])
        ids = torch.zeros(8, dtype=torch.int64, device="cuda:0")
        side = late_fill_on_a_side_stream(torch, torch.zeros(1, device="cuda:0"), 0)
        with torch.cuda.stream(side):
            ids.copy_(torch.arange(8, device="cuda:0"))
            future = cache.load_async(ids)
        with future.result(timeout=60) as hit:
            assert hit.num_tokens == 8
    finally:
        cache.close()
