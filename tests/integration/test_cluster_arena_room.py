"""Agents started together must fit together. Each agent checks /dev/shm for its own arena only,
and a LocalCluster starts them all at once: `kv_transfer.py --agents 1000` started agents with no
word for two minutes, and a demo's two 11.5 GiB arenas on 24 GiB had the OOM killer end it, its
agents left running. LocalCluster.start() now refuses such a cluster before it starts anything."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from mooncake_store import LocalCluster, NoCapacity
from mooncake_store.tiers.host import SHM_DIR, arenas_refused, memory_available_bytes


def shm_free() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def test_arenas_past_shm_or_memory_are_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    per_agent = 1 << 30
    agents = shm_free() // per_agent + 1  # one more than /dev/shm holds, each small enough alone
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a server would make its dir
    cluster = LocalCluster(num_agents=agents, host_bytes=per_agent)
    with pytest.raises(NoCapacity) as info:
        cluster.start()
    message = str(info.value)
    assert f"{agents} arena(s) x {per_agent} B = {agents * per_agent} B of shared memory needed" in message
    assert "fewer agents" in message
    assert cluster.server is None and cluster.agents == []  # nothing was started
    assert list(tmp_path.iterdir()) == []


def test_prefaulted_arenas_are_judged_against_available_memory_too() -> None:
    available = memory_available_bytes()
    assert available is not None  # Linux: /proc/meminfo has it
    free = shm_free()
    if free <= available:
        # Where /dev/shm is no larger than the memory, its own check comes first.
        assert arenas_refused(1, free + 1) is not None
        return
    over = available + (1 << 20)  # fits /dev/shm, not the memory
    why = arenas_refused(1, over)
    assert why is not None and "MemAvailable" in why, why
    assert arenas_refused(1, over, prefault=False) is None  # pages taken as used, not at start
