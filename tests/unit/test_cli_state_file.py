"""The state file `mooncake up` writes names processes that `down` kills: it is written whole
(temp file + rename), 0600, and never through a link another user planted in a shared state dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mooncake_cli.state import ClusterState, load_state, save_state


def test_the_state_file_is_written_whole_and_never_through_a_planted_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    monkeypatch.setenv("MOONCAKE_STATE_DIR", str(state_dir))
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    # The temp name used to be cluster.<pid>.tmp, opened with O_TRUNC: a link planted there (for
    # this pid, and for the next few) was followed and its target truncated.
    for pid in range(os.getpid(), os.getpid() + 4):
        (state_dir / f"cluster.{pid}.tmp").symlink_to(victim)
    path = save_state(ClusterState(redis_url="redis://127.0.0.1:1/0", namespace="ns", mode="detached"))
    assert victim.read_text() == "someone else's file\n"
    assert (path.stat().st_mode & 0o777) == 0o600 and not path.is_symlink()
    loaded = load_state()
    assert loaded is not None and loaded.namespace == "ns"
    left = sorted(p.name for p in state_dir.iterdir() if not p.is_symlink() and p != path)
    assert left == [], f"temp files left: {left}"
