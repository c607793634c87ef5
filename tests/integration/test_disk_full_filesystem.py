"""An agent whose --disk is on a filesystem with no free block left cannot write its disk tier's
lock file (ENOSPC). It exited 1 ("any other failure") where no room for a tier is 5, and left
the directory it had made holding an empty lock file, which no later agent's sweep of abandoned
tiers removes (an empty lock file is no tier's): with the default node id (host-pid) each such
start left one more. Needs root to mount a small tmpfs; skipped, saying so, otherwise."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import small_tmpfs


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "mnt") as mount:
        yield mount


def test_an_agent_on_a_full_filesystem_exits_5_and_leaves_nothing(redis_url: str, full_tmpfs: Path) -> None:
    command = [sys.executable, "-m", "mooncake_store.agent", "--redis-url", redis_url, "--namespace", "full-fs"]
    command += ["--host-mem", "4MiB", "--disk", str(full_tmpfs / "tiers"), "--disk-mem", "4KiB", "--no-prefault"]
    refused = subprocess.run([*command, "--node-id", "full-1"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 5, refused.stderr[-500:]
    assert "no room left" in refused.stderr and "lock file" in refused.stderr, refused.stderr[-500:]
    assert sorted(p.name for p in full_tmpfs.iterdir()) == ["other-programs-data"]


def test_an_agent_on_a_filesystem_out_of_inodes_exits_5_and_leaves_nothing(redis_url: str, tmp_path: Path) -> None:
    """Room for its directories but not one more file: the lock file's creation failed with ENOSPC,
    which only the write of its content turned into no room (exit 5); this was exit 1."""
    with small_tmpfs(tmp_path / "mnt", left_bytes=4 << 20, inodes_left=2) as mount:
        before = sorted(p.name for p in mount.iterdir())
        command = [sys.executable, "-m", "mooncake_store.agent", "--redis-url", redis_url, "--namespace", "no-inode"]
        command += ["--host-mem", "4MiB", "--disk", str(mount / "tiers"), "--disk-mem", "64KiB", "--no-prefault"]
        refused = subprocess.run([*command, "--node-id", "inodes-1"], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 5, refused.stderr[-500:]
        assert "no room left" in refused.stderr and "lock file" in refused.stderr, refused.stderr[-500:]
        assert sorted(p.name for p in mount.iterdir()) == before
