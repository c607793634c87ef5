"""`python -m mooncake_store.demo`: runs end to end, and without torch says how to get it."""

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


def test_demo_runs_small() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_store.demo", "--doc-tokens", "700", "--chunk-tokens", "64", "--layers", "2",
         "--new-tokens", "4"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    rows = [line for line in lines if line.startswith(("Q1 ", "Q2 ", "Q3 "))]
    assert len(rows) == 3 and all(row.endswith("= recompute") for row in rows), out.stdout
    assert rows[1].split()[4] == "640"  # Q2 matched the document's 10 full chunks
    assert "chunks written by Q1: 11," in out.stdout  # the 10 document chunks + 1 spanning the question
