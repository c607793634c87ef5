"""An embedded server started over a persist_dir loads its append-only file before it serves:
meanwhile it answers INFO, and every other command with LOADING. start() waited for INFO alone,
so it returned a server whose first command (an agent's registration, a client's lookup) failed
with BusyLoadingError. start() now returns once the data is loaded, and a load that outlasts
startup_timeout_s is a ServerError that says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake_store.embedded import EmbeddedServer
from mooncake_store.errors import ServerError

#: Enough keys that loading them takes a while (about half a second on a 2-core machine).
KEYS = 300_000


def _fill(persist_dir: Path) -> None:
    server = EmbeddedServer(persist_dir=persist_dir).start()
    try:
        client = server.client()
        pipe = client.pipeline(transaction=False)
        for i in range(KEYS):
            pipe.set(f"key:{i}", b"x" * 100)
            if i % 10_000 == 9_999:
                pipe.execute()
        pipe.execute()
        assert client.dbsize() == KEYS
        client.close()
    finally:
        server.stop()


def test_a_server_started_over_its_data_serves_once_start_returns(tmp_path: Path) -> None:
    _fill(tmp_path / "data")
    server = EmbeddedServer(persist_dir=tmp_path / "data", startup_timeout_s=60).start()
    try:
        client = server.client()
        assert client.set("first", b"1")  # BusyLoadingError while the file was still loading
        assert client.dbsize() == KEYS + 1
        client.close()
    finally:
        server.stop()
    assert not server.running

    # A load that outlasts the start's budget fails the start, in words, and leaves no server.
    slow = EmbeddedServer(persist_dir=tmp_path / "data", startup_timeout_s=0.2)
    with pytest.raises(ServerError, match=r"did not (finish loading .*data|answer) on 127\.0\.0\.1:\d+ within 0.2 s"):
        slow.start()
    assert not slow.running
