"""Disk tier review (session 29). A chunk file that could not be removed (its directory made
immutable, a directory put in its place) was forgotten by the tier and left on the disk
uncounted, its error escaped into the sync that freed it, and a tier's close() stopped at it,
leaving every other file; LocalCluster left a killed agent's disk directory behind; a --disk-mem
below one block exited 1 where bad input exits 2."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import refused_agent, wait_until

from mooncake_store import Client, LocalCluster
from mooncake_store.tiers import disk as disk_module
from mooncake_store.tiers.disk import DiskTier

MiB = 1 << 20


def _block_in_place_of(path: Path) -> None:
    """A non-empty directory where a chunk file was: unlink() fails (EISDIR), for root too."""
    path.unlink()
    path.mkdir()
    (path / "keep").write_bytes(b"x")


def test_a_chunk_file_that_cannot_be_removed_stays_counted_until_it_can_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(tmp_path / "node", 16 * MiB)
    entries = {i: tier.write(i, memoryview(np.full(10_000, i, np.uint8))) for i in (1, 2, 3)}
    stuck = tier.path_of(1)
    _block_in_place_of(stuck)
    assert tier.remove(1)  # no OSError out of it: the sync that frees it goes on with its list
    assert tier.used_bytes == sum(e.footprint_bytes for e in entries.values())
    assert "cannot remove the chunk file" in caplog.text and str(stuck) in caplog.text
    assert not tier.remove(1)  # forgotten as an allocation all the same
    monkeypatch.setattr(disk_module, "STUCK_RETRY_S", 0.0)
    assert tier.remove(2)  # tries the stuck file again: still a directory
    assert tier.used_bytes == entries[1].footprint_bytes + entries[3].footprint_bytes
    assert caplog.text.count("cannot remove the chunk file") == 1  # logged once, not at every try
    (stuck / "keep").unlink()
    stuck.rmdir()
    stuck.write_bytes(b"left")  # a file again: the next try removes it
    tier.close()  # removes file 3 and the stuck one on its way
    assert not stuck.exists() and not tier.path_of(3).exists()
    assert not (tmp_path / "node").exists()


def test_closing_a_tier_removes_every_file_it_can_past_one_it_cannot(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "node", 16 * MiB)
    for i in range(1, 6):
        tier.write(i, memoryview(np.full(5000, i, np.uint8)))
    _block_in_place_of(tier.path_of(2))
    tier.close()
    left = sorted(p.name for p in (tmp_path / "node").rglob("*") if p.is_file())
    assert left == ["keep"], left  # only the directory in the way; the other four files went


def test_stopping_a_cluster_removes_a_killed_agents_disk_directory(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], tmp_path: Path
) -> None:
    disks = tmp_path / "disks"
    cluster = make_cluster(
        1, host_bytes=4 * MiB, agent_args=["--disk", str(disks), "--disk-mem", str(32 * MiB), "--no-prefault"]
    )
    client = make_client(cluster)
    for i in range(12):  # three times the host arena: the rest is demoted to disk
        client.put(f"d{i}", np.random.default_rng(i).integers(0, 255, MiB // 2, dtype=np.uint8))
    root = disks / cluster.agents[0].node_id
    assert wait_until(lambda: any(root.rglob("*.mcz")), 20), sorted(root.rglob("*"))
    client.close()
    cluster.agents[0].kill()
    assert root.is_dir()  # a killed agent cannot remove it itself
    cluster.stop()
    assert not root.exists(), sorted(root.rglob("*"))


def test_a_disk_smaller_than_one_block_is_a_usage_error(redis_url: str, tmp_path: Path) -> None:
    status, err = refused_agent(
        "--redis-url", redis_url, "--namespace", f"t-{uuid.uuid4().hex[:10]}", "--host-bytes", "4MiB",
        "--no-prefault", "--disk", str(tmp_path / "disks"), "--disk-mem", "100",
    )  # fmt: skip
    assert status == 2, err
    assert "disk tier capacity 100 B is less than one" in err and "block" in err, err


def test_a_stuck_file_fixed_meanwhile_is_counted_off_once_when_two_retries_overlap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One retry pass failed on a stuck file, another removed it once the directory was fixed and
    counted it off, then the first recorded its failure: the file was stuck again, and the next
    pass counted it off a second time (used below zero, more free room than capacity). The
    interleaving is forced by holding the first pass inside its failed unlink (second diff review)."""
    tier = DiskTier(tmp_path / "node", 16 * MiB)
    for i in (1, 2, 3, 4):
        tier.write(i, memoryview(np.full(10_000, i, np.uint8)))
    stuck = tier.path_of(1)
    _block_in_place_of(stuck)
    tier.remove(1)
    monkeypatch.setattr(disk_module, "STUCK_RETRY_S", 0.0)
    unlink = Path.unlink
    failed, go_on = threading.Event(), threading.Event()

    def held_unlink(self: Path, missing_ok: bool = False) -> None:
        try:
            unlink(self, missing_ok=missing_ok)
        except OSError:
            if self == stuck and threading.current_thread().name == "first-pass":
                failed.set()
                go_on.wait(10)  # the failure is recorded only after the other pass
            raise

    monkeypatch.setattr(Path, "unlink", held_unlink)
    first = threading.Thread(target=tier.remove, args=(2,), name="first-pass")
    first.start()
    assert failed.wait(10)
    (stuck / "keep").unlink()
    stuck.rmdir()  # fixed: the other pass removes it
    tier.remove(3)
    go_on.set()
    first.join(10)
    tier.remove(4)
    assert tier.used_bytes == 0 and tier.free_bytes == tier.capacity_bytes


def test_room_held_by_stuck_files_comes_back_without_another_remove(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retried only at a remove(): a tier whose every file was stuck, and then fixed, refused
    every write and every peer's spill (NoCapacity, 0 B free) until the agent restarted."""
    block = DiskTier.block_size_of(tmp_path)
    tier = DiskTier(tmp_path / "node", 2 * block)
    for i in (1, 2):
        tier.write(i, memoryview(np.full(100, i, np.uint8)))
        _block_in_place_of(tier.path_of(i))
        tier.remove(i)
    assert tier.free_bytes == 0
    for i in (1, 2):  # fixed
        (tier.path_of(i) / "keep").unlink()
        tier.path_of(i).rmdir()
    monkeypatch.setattr(disk_module, "STUCK_RETRY_S", 0.0)
    tier.write(3, memoryview(np.full(100, 3, np.uint8)))  # the write tries them again first
    assert tier.promise({9: block})  # and so does a promise
    assert tier.used_bytes == block and tier.promised_bytes == block


def test_stopping_a_cluster_stops_everything_though_a_killed_agents_directory_cannot_go(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """The sweep's OSError escaped stop(): the other agents were not waited for, the server not
    stopped (second diff review)."""
    disks = tmp_path / "disks"
    cluster = make_cluster(2, host_bytes=4 * MiB, agent_args=["--disk", str(disks), "--disk-mem", str(8 * MiB)])
    killed, other = cluster.agents
    killed.kill()
    claiming = disks / killed.node_id / ".mooncake-disk-tier.lock.claiming-stuck"
    claiming.mkdir()
    (claiming / "keep").write_bytes(b"x")  # not a file: its unlink fails (EISDIR)
    cluster.stop()
    assert not other.alive() and cluster.server is None and cluster.agents == []
