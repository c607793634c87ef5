"""The numbers of a Redis URL's query that redis-py passes on unchecked (timeouts, the read size,
the health-check interval) are checked at load, as the rest of the URL is: taken as given, a timeout
of inf failed at the first connect with an OverflowError (an internal error at the CLI), -1 or nan
with a "bad Redis URL" ConnectError (exit 4), and 0 with "cannot reach Redis" though it answered."""

from __future__ import annotations

import pytest

from mooncake_store.config import load_config
from mooncake_store.errors import ConfigError

URL = "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        ("socket_timeout=inf", "socket_timeout=inf must be > 0 s and <= 86400 s"),
        ("socket_timeout=1e400", "socket_timeout=inf must be > 0 s and <= 86400 s"),
        ("socket_timeout=nan", "socket_timeout=nan must be > 0 s and <= 86400 s"),
        ("socket_timeout=-1", "socket_timeout=-1 must be > 0 s and <= 86400 s"),
        ("socket_timeout=0", "socket_timeout=0 must be > 0 s and <= 86400 s"),
        ("socket_connect_timeout=inf", "socket_connect_timeout=inf must be > 0 s"),
        ("socket_connect_timeout=0", "socket_connect_timeout=0 must be > 0 s"),
        ("socket_read_size=0", "socket_read_size=0 must be >= 1"),
        ("health_check_interval=-1", "health_check_interval=-1 must be >= 0 s"),
    ],
)
def test_a_url_number_out_of_range_is_refused_at_load(query: str, problem: str) -> None:
    url = f"{URL}?{query}"
    with pytest.raises(ConfigError) as caught:
        load_config(env={"MOONCAKE_REDIS_URL": url})
    message = str(caught.value)
    assert message.startswith(f"env MOONCAKE_REDIS_URL={url!r}: "), message
    assert problem in message, message


def test_the_password_stays_hidden_in_the_refusal() -> None:
    with pytest.raises(ConfigError, match=r"socket_timeout=inf") as caught:
        load_config(env={}, overrides={"redis_url": "redis://:sekrit@127.0.0.1:6379/0?socket_timeout=inf"})
    assert "sekrit" not in str(caught.value)


@pytest.mark.parametrize(
    "query",
    ["socket_timeout=2.5", "socket_connect_timeout=86400", "socket_read_size=1", "health_check_interval=0"],
)
def test_a_url_number_in_range_is_taken(query: str) -> None:
    assert load_config(env={}, overrides={"redis_url": f"{URL}?{query}"}).redis_url == f"{URL}?{query}"
