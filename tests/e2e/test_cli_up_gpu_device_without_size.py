"""`mooncake up` with a GPU device named in the environment and no GPU tier size is exit 2 before
anything starts: its agents started with no GPU tier at all, and up reported a cluster up."""

from __future__ import annotations

from .conftest import HOST_MEM, Mooncake, assert_one_line_error


def test_up_refuses_a_device_without_a_size(mooncake: Mooncake) -> None:
    try:
        result = mooncake("up", "--detach", "--agents", "1", "--host-mem", HOST_MEM, env={"MOONCAKE_AGENT_GPU_ID": "0"})
        assert_one_line_error(result, 2, "env MOONCAKE_AGENT_GPU_ID='0': names the GPU tier's device")
        assert not (mooncake.state_dir / "cluster.json").exists()
    finally:
        mooncake("down", "--timeout", "5")
