"""The examples run as the README shows them, with a private cluster they stop themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "kv_transfer.py"), *args], capture_output=True, text=True, timeout=180
    )


def test_kv_transfer_moves_chunks_byte_exact_and_stops_its_cluster() -> None:
    result = _run("--total", "8MiB", "--agents", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stored" in result.stdout and "Traceback" not in result.stderr


def test_kv_transfer_refuses_a_size_it_cannot_read_as_usage() -> None:
    """--total abc ended in a traceback (ConfigError raised outside the example's try)."""
    result = _run("--total", "abc")
    assert result.returncode == 2, result.stderr
    assert "not a size" in result.stderr and "Traceback" not in result.stderr


def test_kv_transfer_refuses_no_agents_as_usage() -> None:
    """--agents 0 started a cluster with nowhere to store, then failed with NoCapacity (exit 1)."""
    result = _run("--agents", "0")
    assert result.returncode == 2, result.stderr
    assert "--agents 0: at least one agent" in result.stderr and "Traceback" not in result.stderr
