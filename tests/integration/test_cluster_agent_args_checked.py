"""LocalCluster(agent_args=...) is judged by the agent's own parser and rules before anything
starts: a typo ("--bogus"), a watermark of 2 or a GPU id without a GPU tier started the server,
then failed as "agent agent-0 exited with status 2 as it started" (a README walk)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from mooncake_store import ConfigError, LocalCluster


@pytest.mark.parametrize(
    ("agent_args", "message"),
    [
        (["--bogus"], "agent flags refused: unrecognized arguments: --bogus"),
        (["--high-watermark", "2"], r"--high-watermark='2': must be > 0 and <= 1"),
        (["--gpu-id", "0"], r"--gpu-id='0': names the GPU tier's device"),
        (["--disk", "/nonexistent/tier"], r"--disk='/nonexistent/tier': needs agent.disk_bytes > 0"),
    ],
    ids=["unknown", "watermark", "gpu-id", "disk-without-size"],
)
def test_agent_args_an_agent_would_refuse_are_refused_before_anything_starts(
    agent_args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a server would make its dir
    with pytest.raises(ConfigError, match=message):
        LocalCluster(1, host_bytes=16 << 20, agent_args=agent_args)
    assert list(tmp_path.iterdir()) == []  # no server was started


def test_agent_args_an_agent_takes_are_taken(tmp_path: Path) -> None:
    disk = ["--disk", str(tmp_path / "disk"), "--disk-mem", "8MiB", "--no-prefault"]
    with LocalCluster(1, host_bytes=16 << 20, agent_args=disk) as cluster:
        assert cluster.agents[0].disk_dir
