"""A GPU device named (agent.gpu_id, --gpu-id) with no GPU tier size given anywhere is refused at
load, as a disk directory without a capacity is: the agent started with no GPU tier, saying nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake_store.config import load_config
from mooncake_store.errors import ConfigError

NO_SIZE = "agent.gpu_bytes (--gpu-mem, env MOONCAKE_AGENT_GPU_BYTES) is not set"


def test_a_device_from_the_environment_without_a_size_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(env={"MOONCAKE_AGENT_GPU_ID": "1"})
    assert str(caught.value).startswith("env MOONCAKE_AGENT_GPU_ID='1': names the GPU tier's device"), caught.value
    assert NO_SIZE in str(caught.value)


def test_a_device_flag_without_a_size_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"^--gpu-id=0: names the GPU tier's device") as caught:
        load_config(env={}, overrides={"agent.gpu_id": 0}, override_flags={"agent.gpu_id": "--gpu-id"})
    assert NO_SIZE in str(caught.value)


def test_a_device_in_the_file_without_a_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[agent]\ngpu_id = 2\n")
    with pytest.raises(ConfigError, match=f"^file {path}: agent.gpu_id=2: names the GPU tier's device"):
        load_config(file=path, env={})


@pytest.mark.parametrize("size", ["8GiB", "0"])
def test_a_device_with_a_size_given_is_taken(size: str) -> None:
    """A size of 0 given on purpose is no GPU tier, as the user said (a node without a GPU whose
    shared file names a device)."""
    config = load_config(env={"MOONCAKE_AGENT_GPU_ID": "1", "MOONCAKE_AGENT_GPU_BYTES": size})
    assert config.agent.gpu_id == 1


def test_neither_given_is_no_gpu_tier() -> None:
    assert load_config(env={}).agent.gpu_bytes == 0
