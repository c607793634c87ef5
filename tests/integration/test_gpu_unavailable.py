"""Without a usable CUDA device the GPU paths fail with clear errors and the rest runs unchanged."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import pytest

from mooncake_store import Client, LocalCluster, MooncakeError
from mooncake_store.tiers.gpu_arrays import cuda_status
from mooncake_store.tiers.host import HostArena

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


def test_pinning_without_cuda_is_refused_once_and_views_still_work(caplog: pytest.LogCaptureFixture) -> None:
    arena = HostArena.create(f"mooncake-test-pin-{uuid.uuid4().hex}", 1 << 20)
    try:
        with caplog.at_level(logging.WARNING, logger="mooncake_store.tiers.host"):
            assert arena.pin_for_devices() is False
            assert arena.pin_for_devices() is False  # asked once, not on every device read
        refusals = [r.getMessage() for r in caplog.records if "stay pageable" in r.getMessage()]
        assert len(refusals) == 1 and arena.name in refusals[0] and ("cupy" in refusals[0] or "CUDA" in refusals[0])
        assert not arena.pinned
        with arena.device_view(4096, 100) as view:
            view[:3] = b"abc"
            assert view.nbytes == 100
        with arena.device_view(4096, 3) as view:
            assert view.tobytes() == b"abc"
    finally:
        arena.close()
    assert arena.closed


def test_device_get_without_cupy_is_a_clear_error(shared_client: Client) -> None:
    shared_client.put("for-device", b"abc")
    with pytest.raises(MooncakeError, match=r"cupy|CUDA"):
        shared_client.get("for-device", device="cuda:0")
    assert shared_client.get("for-device").tobytes() == b"abc"  # the host path is unaffected
