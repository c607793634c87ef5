"""A put whose writer stalls past the agent's reservation timeout: the agent frees the reservation
and refuses the late bytes. Over shm that is ReservationExpired and the put is placed again; over
TCP the agent's STALE reached the caller as a reader's StaleLocation, with no retry."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.client.replica_writes import ReplicaWriter


def _stall_first_write(client: Client, seconds: float) -> list[int]:
    """The client's first replica write (either path) sleeps ``seconds`` before it starts; the
    writes themselves are the real ones. Returns the count of writes made."""
    writes = client._puts.writes
    calls: list[int] = []

    def stalling(original: Callable[..., Any]) -> Callable[..., Any]:
        def write(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 1:
                time.sleep(seconds)
            return original(*args, **kwargs)

        return write

    writes.write_replica = stalling(writes.write_replica)  # type: ignore[method-assign]
    writes.copy_fenced = stalling(writes.copy_fenced)  # type: ignore[method-assign]
    assert isinstance(writes, ReplicaWriter)
    return calls


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_put_that_outlives_its_reservation_is_placed_again(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client], transport: str
) -> None:
    # Each retry must get from its RESERVE to its commit within the timeout: 0.3 s leaves a loaded
    # machine room for that, and the stall outlasts it five times over.
    agent = make_inproc_agent(host_bytes=8 << 20, reserve_timeout_s=0.3, sync_interval_s=0.05)
    client = clients(agent, transports=(transport,))
    calls = _stall_first_write(client, 1.5)
    value = np.arange(1024, dtype=np.int64)
    client.put("late", value)
    assert len(calls) >= 2, "the stalled write was not retried"
    assert np.array_equal(client.get("late"), value)
