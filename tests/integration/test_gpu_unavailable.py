"""Without a usable CUDA device the GPU paths fail with clear errors and the rest runs unchanged."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mooncake_store import Client, LocalCluster, MooncakeError
from mooncake_store.tiers.gpu_arrays import cuda_status

USABLE, WHY = cuda_status(0)
pytestmark = pytest.mark.skipif(USABLE, reason=f"this machine has a usable GPU ({WHY}); see tests/gpu/")


def test_capability_check_says_why() -> None:
    usable, why = cuda_status(0)
    assert usable is False
    assert "cupy" in why or "CUDA" in why


def test_agent_with_gpu_tier_refuses_to_start_and_cleans_up(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(0)
    with pytest.raises(MooncakeError, match="cannot create a GPU tier on device 0"):
        cluster.add_agent(node_id="gpu-less", extra_args=["--gpu-mem", "64MiB"])


def test_device_get_without_cupy_is_a_clear_error(shared_client: Client) -> None:
    shared_client.put("for-device", b"abc")
    with pytest.raises(MooncakeError, match=r"cupy|CUDA"):
        shared_client.get("for-device", device="cuda:0")
    assert shared_client.get("for-device").tobytes() == b"abc"  # the host path is unaffected
