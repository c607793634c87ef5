"""GPU review (session 29), desk-checked: a CUDA torch tensor is held to the rules a CPU tensor
is (client/buffers.py). get_into's device path filled an ``out`` that requires grad and left its
version alone (a backward that saved it ran on with wrong gradients), and a lazy conjugate view
was stored as its unconjugated bytes. Skipped without cupy and a CUDA device
(tests/gpu/conftest.py); the CPU twins of these checks are in tests/integration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mooncake_store import Client, InvalidValue, LocalCluster


def test_a_cuda_out_that_requires_grad_is_refused_and_nothing_is_written(  # type: ignore[no-untyped-def]
    cuda_torch, gpu_cluster: LocalCluster, make_client: Callable[..., Client]
) -> None:
    torch = cuda_torch
    client = make_client(gpu_cluster)
    client.put("grad-src", np.full(16, 5.0, dtype=np.float32))
    out = torch.zeros(16, device="cuda:0", requires_grad=True)
    with pytest.raises(InvalidValue, match="requires grad"):
        client.get_into("grad-src", out)
    assert not out.detach().any().item()
    assert client.get_into("grad-src", out.detach()) == 64  # the same memory, detached: filled
    assert out.detach().eq(5.0).all().item()


def test_a_cuda_out_saved_for_backward_makes_backward_refuse_once_filled(  # type: ignore[no-untyped-def]
    cuda_torch, gpu_cluster: LocalCluster, make_client: Callable[..., Client]
) -> None:
    torch = cuda_torch
    client = make_client(gpu_cluster)
    client.put("saved", np.full(4, 5.0, dtype=np.float32))
    weights = torch.ones(4, device="cuda:0", requires_grad=True)
    saved = torch.zeros(4, device="cuda:0")
    loss = (weights * saved).sum()  # saves `saved` for the backward pass
    before = saved._version
    client.get_into("saved", saved)
    assert saved._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("lazy", ["conj", "neg"])
def test_a_lazy_conjugate_or_negative_cuda_view_is_refused_as_a_value(  # type: ignore[no-untyped-def]
    cuda_torch, lazy: str, gpu_cluster: LocalCluster, make_client: Callable[..., Client]
) -> None:
    torch = cuda_torch
    client = make_client(gpu_cluster)
    base = torch.tensor([1 + 2j, 3 - 4j], device="cuda:0")
    view: Any = base.conj() if lazy == "conj" else torch._neg_view(base)
    bit = "conjugate" if lazy == "conj" else "negative"
    with pytest.raises(InvalidValue, match=rf"is a lazy {bit} view: its memory holds other numbers"):
        client.put("lazy", view)
    assert client.object_meta("lazy") is None
    resolved = view.resolve_conj() if lazy == "conj" else view.resolve_neg()
    client.put("lazy", resolved)
    assert np.array_equal(client.get("lazy"), resolved.cpu().numpy())


def test_get_many_into_fills_device_arrays_among_host_ones(  # type: ignore[no-untyped-def]
    cupy, gpu_cluster: LocalCluster, make_client: Callable[..., Client]
) -> None:
    """It refused any device array (as no writable host buffer), though get_into takes them and
    get_many_into_async already waited on their streams."""
    client = make_client(gpu_cluster)
    values = {f"many-{i}": np.arange(1024, dtype=np.float32) * (i + 1) for i in range(3)}
    client.put_many(values)
    outs = [cupy.zeros(1024, dtype=cupy.float32), np.zeros(1024, dtype=np.float32)]
    outs.append(cupy.zeros(1024, dtype=cupy.float32))
    assert client.get_many_into(list(values), outs) == [4096, 4096, 4096]
    for out, value in zip(outs, values.values(), strict=True):
        assert np.array_equal(cupy.asnumpy(out) if isinstance(out, cupy.ndarray) else out, value)
    assert client.get_many_into_async(list(values)[:1], outs[:1]).result(30) == [4096]
    with pytest.raises(InvalidValue, match="2 keys but 1 output buffers"):
        client.get_many_into(list(values)[:2], outs[:1])
