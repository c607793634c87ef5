"""A Redis password given in the URL's query (``?password=``, which redis-py reads as well as
``user:password@``) never reaches the terminal."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake_store.embedded import EmbeddedServer

from .conftest import Mooncake

SECRET = "s3cret-in-the-query"


@pytest.fixture
def guarded_server() -> Iterator[EmbeddedServer]:
    server = EmbeddedServer().start()
    try:
        server.client().config_set("requirepass", SECRET)
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("password", [SECRET, SECRET + "-wrong"], ids=["right", "wrong"])
@pytest.mark.parametrize("command", [["stat", "--json"], ["doctor"], ["ls"]])
def test_a_password_in_the_query_is_never_printed(
    mooncake: Mooncake, guarded_server: EmbeddedServer, command: list[str], password: str
) -> None:
    url = f"{guarded_server.url}?password={password}"
    result = mooncake(*command, "--redis-url", url, "--namespace", "hidden")
    printed = (result.stdout + result.stderr).decode(errors="replace")
    assert SECRET not in printed, printed
    if command[0] != "ls" or password != SECRET:  # ls prints no URL when it succeeds
        assert "password=***" in printed, printed  # the URL is named, redacted
