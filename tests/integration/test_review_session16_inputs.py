"""Inputs a read of the README met (review, sixteenth session): each now a MooncakeError that names
the value and what was expected, and a refused start leaves nothing behind."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis

import mooncake_store
from mooncake_store import ConfigError, ConnectError, NoCapacity, connect
from mooncake_store.config import load_config
from mooncake_store.tiers.disk import DiskTier


def test_a_config_file_of_the_wrong_type_is_a_config_error(redis_url: str) -> None:
    """connect(config_file=5) raised a bare TypeError from pathlib."""
    with pytest.raises(ConfigError, match=r"config_file must be a path .*got int 5"):
        connect(redis_url, config_file=5)  # type: ignore[arg-type]


def test_credentials_the_server_refuses_are_not_reported_as_unreachable(redis_url: str) -> None:
    """A wrong password said "cannot reach Redis" and advised starting a cluster; the server was
    there and refused the login. A user of the session's server with a password of its own."""
    admin = redis.Redis.from_url(redis_url)
    user = f"mc-{uuid.uuid4().hex[:8]}"
    admin.acl_setuser(user, enabled=True, passwords=["+right-password"], keys=["*"], commands=["+@all"])
    try:
        host_port = redis_url.split("://", 1)[1]
        with pytest.raises(ConnectError) as caught:
            connect(f"redis://{user}:wrong-password@{host_port}")
        message = str(caught.value)
        assert "refused the credentials" in message and "mooncake up" not in message, message
        assert "wrong-password" not in message  # never printed
        with connect(f"redis://{user}:right-password@{host_port}") as client:
            assert client.stat().objects == 0
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_a_port_out_of_range_is_named_in_our_words() -> None:
    with pytest.raises(ConfigError, match=r"port must be 1\.\.65535, got 70000"):
        load_config(overrides={"redis_url": "redis://127.0.0.1:70000/0"})


def test_a_disk_tier_refused_for_its_capacity_creates_no_directory(tmp_path: Path) -> None:
    """The room check ran after the directory was made: a refused start left an empty directory
    with no lock file, which no later sweep of abandoned tiers removes."""
    root = tmp_path / "disk" / "node-a"
    with pytest.raises(NoCapacity, match="more than the filesystem"):
        DiskTier(root, 1 << 60)
    assert not (tmp_path / "disk").exists()


def test_gpu_unavailable_is_one_of_the_exported_errors() -> None:
    from mooncake_store.errors import GpuUnavailable
    from mooncake_store.tiers import gpu_arrays

    assert mooncake_store.GpuUnavailable is GpuUnavailable is gpu_arrays.GpuUnavailable
    assert issubclass(GpuUnavailable, mooncake_store.MooncakeError)
