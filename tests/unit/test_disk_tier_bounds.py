"""What a disk tier may touch under its --disk directory, and who may read what it writes."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np

from mooncake_store.tiers.disk import DiskTier
from mooncake_store.tiers.disk_dir import LOCK_NAME, sweep_abandoned_tiers


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_sweep_leaves_other_programs_directories_alone(tmp_path: Path) -> None:
    """An agent's start sweeps the directories under --disk whose tier is gone. Any directory
    with a free file named ".lock" counted as one, and the sweep deleted that program's ".tmp"
    files, its lock and its two-letter subdirectories. Only a directory whose lock has the
    tier's own name and content is a tier's; and only names a tier writes are removed from it."""
    other = tmp_path / "myapp"
    for name in (".lock", "ab/upload.tmp", "data/report.tmp", "keep.txt"):
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        (other / name).write_text("the other program's")
    unmarked = tmp_path / "half"  # a lock file of the tier's name but not its content
    (unmarked / "cd").mkdir(parents=True)
    (unmarked / LOCK_NAME).write_text("")
    (unmarked / "cd" / "00000000000000cd.mcz").write_text("?")
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    outside.mkdir()
    dead = DiskTier(outside / "dead", 1 << 20)
    dead.write(0xEF, memoryview(np.ones(1000, np.uint8)))
    dead.close(remove_files=False)
    (tmp_path / "link").symlink_to(outside / "dead")  # a link leads out of the --disk directory
    before = {d: _files(d) for d in (other, unmarked, outside)}
    assert sweep_abandoned_tiers(tmp_path, keep=tmp_path / "mine") == []
    assert {d: _files(d) for d in (other, unmarked, outside)} == before


def test_a_sweep_inside_a_dead_tier_removes_only_what_the_tier_wrote(tmp_path: Path) -> None:
    dead = DiskTier(tmp_path / "dead", 1 << 20)
    dead.write(0x12, memoryview(np.ones(1000, np.uint8)))
    dead.close(remove_files=False)
    (tmp_path / "dead" / "12" / "notes.tmp").write_text("someone's")
    (tmp_path / "dead" / "12" / "00000000000000ab.mcz").write_text("in the wrong subdirectory")
    assert sweep_abandoned_tiers(tmp_path, keep=tmp_path / "mine") == []  # not empty: it stays
    assert _files(tmp_path / "dead") == {"12", "12/notes.tmp", "12/00000000000000ab.mcz"}


def test_a_tiers_directory_and_files_are_its_owners_alone(tmp_path: Path) -> None:
    """The host arena is 0600; the disk tier's directories were 0755 and its chunk files 0644 (the
    umask's), so any local user could read the cached KV data there."""
    root = tmp_path / "agent-0"
    root.mkdir(mode=0o755)  # left open by an earlier build
    tier = DiskTier(root, 1 << 20)
    try:
        tier.write(7, memoryview(np.ones(1000, np.uint8)))
        path = tier.path_of(7)
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (root, path.parent, path)}
        assert modes == {root.name: 0o700, path.parent.name: 0o700, path.name: 0o600}
    finally:
        tier.close()
