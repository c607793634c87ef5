"""8b800f3: NodeView records a failed table read's exception (self._read_error) to hand on to the
callers queued behind it, and keeps it until the next read. The exception carries its traceback,
whose frames hold the failed call's locals: the value a put was storing stays alive, with the
client, until some later call reads the table again (never, for a client that was being closed or
went idle because the index is gone)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster
from mooncake_store.client import node_view
from mooncake_store.errors import ConnectError


def test_a_failed_table_read_does_not_keep_the_put_value_alive(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = make_cluster(1, host_bytes=64 << 20)
    client = make_client(cluster, timeout_s=2.0)
    client.put("warm", b"x" * 64)
    monkeypatch.setattr(node_view, "NODE_TABLE_TTL_S", 0.0)  # the next put reads the table

    def stalled() -> int:
        raise ConnectError("cannot read the server time from 127.0.0.1: timed out (injected)")

    monkeypatch.setattr(client.index, "server_time_ms", stalled)
    values = [np.ones(32 << 20, np.uint8)]  # 32 MiB the caller is done with once put() returns
    alive = weakref.ref(values[0])
    with pytest.raises(ConnectError):
        client.put("big", values[0])
    values.clear()
    gc.collect()
    held = client._view._read_error if hasattr(client, "_view") else None
    assert alive() is None, f"the put's 32 MiB value is still referenced (NodeView._read_error={held!r})"
