"""doctor's rdma line for each answer pyverbs can give (session 29 review). No branch with pyverbs
installed was ever run: on a host with pyverbs but no RDMA kernel support (the common case) it
printed "! listing devices failed: Failed to get devices list", and with devices a ✓ that read as
"data goes over RDMA", which no transport does yet. A stand-in ``pyverbs`` package on the path
gives each answer the real bindings give (device.get_device_list(): raising, [], devices with
bytes names); SYSFS_PATH points libibverbs' sysfs lookup, as rdma-core reads it, at a test dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import Mooncake

ANSWERS = {
    "raises": "def get_device_list():\n    raise RuntimeError('Failed to get devices list')\n",
    "none": "def get_device_list():\n    return []\n",
    "devices": (
        "class _Device:\n    def __init__(self, name):\n        self.name = name\n\n"
        "def get_device_list():\n    return [_Device(b'mlx5_0'), _Device(b'mlx5_1')]\n"
    ),
}


def _rdma_line(mooncake: Mooncake, tmp_path: Path, answer: str, *, verbs_sysfs: bool) -> dict[str, str]:
    package = tmp_path / "site" / "pyverbs"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "device.py").write_text(ANSWERS[answer])
    sysfs = tmp_path / "sys"
    if verbs_sysfs:
        (sysfs / "class" / "infiniband_verbs").mkdir(parents=True)
    env = {"PYTHONPATH": str(tmp_path / "site"), "SYSFS_PATH": str(sysfs)}
    result = mooncake("doctor", "--json", "--redis-url", "redis://127.0.0.1:1/0", env=env)
    return dict(next(c for c in json.loads(result.stdout) if c["name"] == "rdma"))


def test_no_rdma_kernel_support_is_a_skip_that_says_so(mooncake: Mooncake, tmp_path: Path) -> None:
    line = _rdma_line(mooncake, tmp_path, "raises", verbs_sysfs=False)
    assert line["status"] == "skip", line
    assert "no RDMA kernel support" in line["detail"] and "infiniband_verbs missing" in line["detail"]


@pytest.mark.parametrize(
    ("answer", "status", "needle"),
    [
        ("raises", "warn", "listing devices failed: Failed to get devices list"),
        ("none", "skip", "no RDMA devices"),
        ("devices", "ok", "devices: mlx5_0, mlx5_1 (no RDMA transport is built yet"),
    ],
)
def test_each_answer_of_pyverbs_is_reported(
    mooncake: Mooncake, tmp_path: Path, answer: str, status: str, needle: str
) -> None:
    line = _rdma_line(mooncake, tmp_path, answer, verbs_sysfs=True)
    assert line["status"] == status and needle in line["detail"], line
