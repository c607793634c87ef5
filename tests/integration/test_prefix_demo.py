"""`python -m mooncake_store.demo` without torch says how to get it. The demo's run end to end is
tests/e2e/test_cli_demo_bench.py's (`mooncake demo`, the same code): one run of it, not two."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def test_demo_without_torch_says_how_to_install(tmp_path: Path) -> None:
    (tmp_path / "torch.py").write_text("raise ImportError('No module named torch')\n")
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_store.demo"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2
    assert "pip install 'mooncake-store[hf]'" in out.stderr
