"""A put whose replica write timed out on a stalled agent (SIGSTOP by its PID) then asked that
same agent, on the put's own thread, to free the reservation, and waited out timeout_s a second
time before placing the put elsewhere (review, thirty-sixth session). The FREE to the node whose
write failed now goes on a thread of its own; the room still comes back once the agent runs."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import numpy as np
from helpers import stop_process, wait_until

from mooncake_store import Client, LocalCluster


def test_the_free_to_a_stalled_agent_does_not_hold_the_put_up(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2, heartbeat_ttl_s=10.0, reserve_timeout_s=300.0)
    client = make_client(cluster, transports=("tcp",), timeout_s=2.0)
    client.put("warm", b"x", replicas=2)  # the node table and the connections in place
    tcp = client._tcp
    real_write = tcp.write_from
    stalled: list[int] = []

    def stall_then_write(endpoint: str, *args: object, **kwargs: object) -> object:
        if not stalled:
            victim = next(a for a in cluster.agents if a.endpoint == endpoint)
            stalled.append(victim.process.pid)
            stop_process(victim.process.pid)
        return real_write(endpoint, *args, **kwargs)  # type: ignore[arg-type]

    put_thread = threading.current_thread()
    frees: list[tuple[bool, list[str]]] = []
    real_free = client._puts._free

    def spy_free(endpoints: dict[str, list[int]]) -> None:
        frees.append((threading.current_thread() is put_thread, sorted(endpoints)))
        real_free(endpoints)

    client._puts._free = spy_free  # type: ignore[method-assign]
    tcp.write_from = stall_then_write  # type: ignore[method-assign]
    value = np.random.default_rng(36).integers(0, 255, 1 << 20, dtype=np.uint8)
    try:
        client.put("past-the-stalled", value)
    finally:
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)
    assert stalled, "the put never wrote over TCP"
    victim = next(a for a in cluster.agents if a.process.pid == stalled[0])
    meta = client.object_meta("past-the-stalled")
    assert meta is not None and [r.node_id for r in meta.replicas] != [victim.node_id]
    assert np.array_equal(client.get("past-the-stalled"), value)
    # The stalled agent was asked to free the reservation, but not on the put's own thread, which
    # would have waited out timeout_s on it once more.
    asked = [on_put_thread for on_put_thread, endpoints in frees if victim.endpoint in endpoints]
    assert asked == [False], frees
    # And the room comes back once the agent runs again, well before its reserve timeout (300 s).

    def room_back() -> bool:
        host = client._node_table(refresh=True)[victim.node_id].tiers
        return sum(t.used_bytes for t in host) < 1 << 20

    assert wait_until(room_back, 20.0), client._node_table(refresh=True)[victim.node_id]
