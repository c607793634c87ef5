"""The chaos kit's check of agents against the index (tests/tier_audit.py) on an agent with a GPU
tier, a host tier and a disk tier: device arrays put into the GPU tier, demoted to host and to disk
under pressure, each tier's use and objects equal to what the index names there. Skipped where
cupy sees no CUDA device (tests/gpu/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from helpers import random_bytes, wait_until
from tier_audit import audit_tiers

from mooncake_store import Client, LocalCluster

MiB = 1 << 20


def test_check_covers_gpu_host_and_disk_tiers(
    cupy, make_cluster: Callable[..., LocalCluster], make_client, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(0, reserve_timeout_s=2.0)
    marks = ["--high-watermark", "0.8", "--low-watermark", "0.5"]
    disk = ["--disk", str(tmp_path / "disk"), "--disk-mem", "64MiB"]
    agent = cluster.add_agent(
        node_id="gpu-0", extra_args=["--host-bytes", str(8 * MiB), "--gpu-mem", str(8 * MiB), *disk, *marks]
    )
    client: Client = make_client(cluster, lease_ms=200, timeout_s=20)
    values = {f"g/{i}": random_bytes(MiB, i) for i in range(24)}
    for key, value in values.items():
        client.put(key, cupy.asarray(value))

    def tiers() -> set[str]:
        return {str(m.replicas[0].tier) for k in values if (m := client.object_meta(k)) is not None}

    assert wait_until(lambda: {"gpu", "disk"} <= tiers(), 20), tiers()
    for key, value in values.items():
        assert np.array_equal(client.get(key), value), key

    def audit() -> tuple[bool, str]:
        found = audit_tiers(client, ["gpu-0"], disk_dirs={"gpu-0": agent.disk_dir})
        return found.ok, str(found)

    assert wait_until(lambda: audit()[0], 15, 0.5), audit()[1]
    assert "gpu-0 gpu: agent" in audit()[1], audit()[1]  # checked, not passed over
