"""A Client built directly checks its URL as connect() and the config loader do: it took it
unchecked, and a mistake in it (a port 0, a query's timeout of inf) failed at the first connect
as an unreachable server, ConnectError, exit 4 at the CLI, rather than as the mistake it was."""

from __future__ import annotations

import pytest

from mooncake_store import Client
from mooncake_store.errors import ConfigError


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://127.0.0.1:0", "port must be 1..65535"),
        ("redis://127.0.0.1:1/?socket_timeout=inf", "socket_timeout=inf must be > 0 s"),
        ("http://127.0.0.1:1", "scheme must be redis://, rediss:// or unix://"),
        ("", "use None, not an empty string"),
    ],
    ids=["port-0", "timeout-inf", "scheme", "empty"],
)
def test_a_client_built_directly_refuses_a_bad_url_by_its_mistake(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=f"redis_url=.*{problem}"):
        Client(url)
