"""A same-host read whose lookup came just before its agent was restarted under the same node id:
the client read the node table afresh (its copy predated the new incarnation), mapped the new
arena and copied from the old replica's offset there, returning another object's bytes as the
key's. Over TCP the agent refuses an alloc id of an earlier incarnation; over shm no agent is
asked, so the client must see it. Real agent processes, killed and restarted by their own pids."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, KeyNotFound, LocalCluster
from mooncake_store.index.client import LookupResult

MiB = 1 << 20


@pytest.mark.parametrize("transports", [("shm",), ("shm", "tcp")], ids=["shm-only", "default"])
def test_a_read_looked_up_before_its_agent_restarted_never_copies_the_new_arena(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], transports: tuple[str, ...]
) -> None:
    cluster = make_cluster(0, heartbeat_ttl_s=1.5)
    old = cluster.add_agent(node_id="agent-0")
    writer = make_client(cluster)
    writer.put("victim", np.full(MiB, 0xAA, np.uint8))
    reader = make_client(cluster, transports=transports)
    assert np.array_equal(reader.get("victim"), np.full(MiB, 0xAA, np.uint8))  # its arena mapped
    looked_up = reader.index.lookup
    restarted: list[int] = []

    def lookup_then_restart(keys: list[str], *, lease_ms: int, counted: bool = True) -> LookupResult:
        """The reader's lookup, then (once) what happens before its copy: the agent dies, its
        supervisor starts it again under the same node id, and a writer stores there."""
        result = looked_up(keys, lease_ms=lease_ms, counted=counted)
        if lease_ms and not restarted:
            old.kill()
            new = cluster.add_agent(node_id="agent-0")  # waits out the dead one's deadline
            restarted.append(new.pid)
            writer.put("other", np.full(MiB, 0x55, np.uint8))
        return result

    reader.index.lookup = lookup_then_restart  # type: ignore[method-assign]
    try:
        got = reader.get("victim")
    except KeyNotFound:
        pass  # lost with its only node: the right answer
    else:
        assert np.array_equal(got, np.full(MiB, 0xAA, np.uint8)), f"read another object's bytes: {np.unique(got)}"
    assert restarted
