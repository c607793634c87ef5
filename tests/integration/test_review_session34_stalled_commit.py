"""A put whose commit meets a stalled index (SIGSTOP) fails at its timeout_s, once: its abandon sent
put_revoke to the same silent server and waited out a second timeout_s before the ConnectError came.
The agents' syncs revoke what it left pending once the index answers again."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import stop_process, wait_until
from index_audit import settled_audit

from mooncake_store import LocalCluster, connect
from mooncake_store.embedded import EmbeddedServer
from mooncake_store.errors import ConnectError


def test_a_put_whose_commit_meets_a_stalled_index_asks_it_nothing_more() -> None:
    server = EmbeddedServer().start()
    try:
        with (
            LocalCluster(1, redis_url=server.url, namespace="stall-commit", host_bytes=8 << 20, reserve_timeout_s=2),
            connect(server.url, namespace="stall-commit", timeout_s=2.0) as client,
        ):
            client.put("warm", b"w" * 100)
            real_commit, real_revoke = client.index.put_commit, client.index.put_revoke
            revokes: list[object] = []

            def stall_then_commit(*args: object, **kwargs: object) -> object:
                stop_process(server.pid)
                return real_commit(*args, **kwargs)  # type: ignore[arg-type]

            client.index.put_commit = stall_then_commit  # type: ignore[method-assign]
            client.index.put_revoke = lambda put_ids: revokes.append(put_ids) or 0  # type: ignore[method-assign]
            try:
                with pytest.raises(ConnectError, match="did not answer put_commit") as caught:
                    client.put("k", b"x" * 1000)
            finally:
                os.kill(server.pid, signal.SIGCONT)
                client.index.put_commit, client.index.put_revoke = real_commit, real_revoke  # type: ignore[method-assign]
            assert server.url in str(caught.value)
            assert revokes == []  # a revoke to the silent server waited out another timeout_s
            # Once it answers: nothing left pending, the arena's use is what the index names.
            assert wait_until(lambda: not client.index.redis.keys(client.index.prefix + "pend:*"), 30)
            assert settled_audit(client.index, timeout_s=20) == []
    finally:
        if server.running:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()
