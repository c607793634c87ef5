"""GPU tests run only where cupy sees a CUDA device; elsewhere each is skipped saying why."""

from __future__ import annotations

import pytest

from mooncake_store.tiers.gpu_arrays import cuda_status

USABLE, WHY = cuda_status(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if USABLE:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device and cupy: {WHY}")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
