"""An agent whose start fails after its disk tier was made (its listen port taken, no GPU for
--gpu-mem) leaves no disk directory behind, as a stopped agent does not: it released the
directory's lock but kept the directory and its lock file (a probe of 2026-12-07). Nothing of
an earlier incarnation is lost by removing it: the tier clears the chunk files it finds at start."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest

from mooncake_store.agent.node import Agent
from mooncake_store.config import AgentConfig
from mooncake_store.errors import MooncakeError
from mooncake_store.tiers.host import namespace_prefix

MiB = 1 << 20


def test_an_agent_that_cannot_listen_leaves_no_disk_directory(redis_url: str, tmp_path: Path) -> None:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "other").mkdir()  # another agent's directory beside it stays
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = AgentConfig(
            node_id="half-built",
            host_bytes=4 * MiB,
            prefault=False,
            disk_path=str(disk),
            disk_bytes=64 * MiB,
            listen=f"127.0.0.1:{port}",
        )
        with pytest.raises(MooncakeError, match=str(port)):
            Agent(config, redis_url=redis_url, namespace=namespace)
    assert sorted(p.name for p in disk.iterdir()) == ["other"]
    assert not list(Path("/dev/shm").glob(namespace_prefix(namespace) + "*"))
