"""A Client inherited by a forked child (multiprocessing's default start method on Linux, as
engine workers are often started): its threads do not exist there, so a transfer striped over
its pool waited forever, past timeout_s; its sockets are the parent's too. Now every call in the
child says to connect() in each process, and the child's close() leaves the parent's
connections alone."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from helpers import in_forked_child

from mooncake_store import Client, LocalCluster, MooncakeError

MiB = 1 << 20


def test_a_forked_child_is_told_to_connect_and_leaves_the_parents_client_working(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, host_bytes=32 * MiB)
    client = make_client(cluster, transports=("tcp",), timeout_s=5.0)
    value = np.arange(6 * MiB // 8, dtype=np.int64)  # over stripe_bytes: striped over the pool
    client.put("big", value)
    assert np.array_equal(client.get("big"), value)  # the pool's threads and sockets exist now

    def get_then_close() -> str:
        try:
            client.get("big")
            return "read"
        except MooncakeError as exc:
            client.close()
            return str(exc)

    said = in_forked_child(get_then_close)
    assert f"connected in process {os.getpid()}" in said and "call mooncake_store.connect() in each process" in said
    future = client.get_async("big")  # the parent's pool and connections are whole
    assert np.array_equal(future.result(timeout=30), value)
    assert np.array_equal(client.get("big"), value)
