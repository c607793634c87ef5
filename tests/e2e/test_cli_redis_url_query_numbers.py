"""A Redis URL whose query sets a timeout redis-py cannot use is bad input, exit 2 naming it, for the
CLI as for connect(): `?socket_timeout=inf` was an internal error (exit 1) and `?socket_timeout=0`
"cannot reach Redis" (exit 4) while the server answered."""

from __future__ import annotations

import pytest

from mooncake_store import connect
from mooncake_store.errors import ConfigError

from .conftest import Mooncake, assert_one_line_error


@pytest.mark.parametrize("value", ["inf", "-1", "0"])
def test_stat_refuses_the_timeout_as_bad_input(mooncake: Mooncake, redis_url: str, value: str) -> None:
    result = mooncake("--redis-url", f"{redis_url}?socket_timeout={value}", "stat")
    assert_one_line_error(result, 2, f"socket_timeout={value} must be > 0 s and <= 86400 s")


def test_agent_refuses_it_before_it_starts(mooncake: Mooncake, redis_url: str) -> None:
    result = mooncake("agent", "--redis-url", f"{redis_url}?socket_connect_timeout=inf", "--host-mem", "64KiB")
    assert_one_line_error(result, 2, "socket_connect_timeout=inf must be > 0 s")


def test_connect_raises_a_config_error(redis_url: str) -> None:
    with pytest.raises(ConfigError, match=r"socket_timeout=inf must be > 0 s"):
        connect(f"{redis_url}?socket_timeout=inf")
