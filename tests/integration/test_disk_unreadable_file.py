"""A chunk file the agent cannot read for a reason of its own (permissions changed under a non-root
agent, out of descriptors or memory) is kept, and the read fails; its reader was told "agent ...
no longer holds allocation N", which is false (the agent holds it, the index lists it) and hid
where the reason is. The READ's STALE reply now says the file is kept but could not be read."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mooncake_store import connect
from mooncake_store.agent.node import Agent
from mooncake_store.errors import MooncakeError
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.types import TierKind

MiB = 1 << 20


def test_an_unreadable_chunk_file_is_reported_as_kept_not_gone(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = make_inproc_agent(
        host_bytes=1 * MiB,
        disk_path=str(tmp_path / "d"),
        disk_bytes=16 * MiB,
        high_watermark=0.3,
        low_watermark=0.01,
        promote_on_read=False,
        prepare=lambda a: setattr(a.pressure, "run", lambda stop: stop.wait()),
    )
    client = connect(agent.index.url, namespace=agent.namespace, timeout_s=5, lease_ms=50)
    try:
        client.put("kv", np.frombuffer(os.urandom(512 << 10), np.uint8), preferred_node=agent.node_id)
        agent.sync_once()
        agent.pressure.relieve_host()
        meta = agent.index.lookup(["kv"], lease_ms=0).objects[0]
        assert meta is not None and meta.replicas[0].tier == TierKind.DISK
        path = agent.disk.path_of(meta.replicas[0].alloc_id)
        real = DiskTier._read_file

        def denied(at: Path, length: int) -> bytes:  # what a non-root agent meets after `chmod 000`
            if at == path:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(at))
            return real(at, length)

        monkeypatch.setattr(DiskTier, "_read_file", staticmethod(denied))
        with pytest.raises(MooncakeError) as info:
            client.get("kv")
        message = str(info.value)
        assert agent.disk.entry(meta.replicas[0].alloc_id) is not None  # kept, as promised
        assert "no longer holds" not in message, f"misleading: {message}"
        assert "could not read its file now" in message and "the file is kept" in message, message
        monkeypatch.undo()  # readable again: the same object reads back
        assert client.get("kv") is not None
    finally:
        client.close()
