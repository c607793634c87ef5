"""GPU tests run only where cupy sees a CUDA device; elsewhere each is skipped saying why."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mooncake_store import LocalCluster
from mooncake_store.tiers.gpu_arrays import cuda_status

MiB = 1 << 20

USABLE, WHY = cuda_status(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if USABLE:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device and cupy: {WHY}")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture
def cupy():  # type: ignore[no-untyped-def]
    import cupy

    return cupy


@pytest.fixture
def cuda_torch():  # type: ignore[no-untyped-def]
    """torch, where its build reaches the CUDA device; a skip saying so where it does not."""
    import torch  # a test requirement: its absence is a failure, not a skip

    if not torch.cuda.is_available():  # capability: this torch build cannot reach the device
        pytest.skip(f"torch {torch.__version__} sees no CUDA device (a CPU build?): no CUDA tensors to test")
    return torch


@pytest.fixture
def gpu_cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    """One agent with a 32 MiB GPU tier and a 64 MiB host arena."""
    cluster = make_cluster(0)
    cluster.add_agent(node_id="gpu-0", extra_args=["--host-bytes", str(64 * MiB), "--gpu-mem", str(32 * MiB)])
    return cluster
