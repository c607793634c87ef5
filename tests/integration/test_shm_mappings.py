"""The client's table of mapped arenas (transport/shm.py) under threads: mapping a new agent's
arena (MAP_POPULATE, ~0.1 s per GiB) held the table's one lock, so every shm read and write of
the process, to any agent, waited for it; and a read whose segment another thread unmapped
between lookup and copy failed instead of trying the next replica."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster
from mooncake_store.tiers import host as host_module
from mooncake_store.tiers.host import SharedSegment


def test_mapping_one_arena_holds_up_no_other(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mapping of agent-1's arena is held open (its attach waits on an event) while another
    thread reads from agent-0, whose arena is mapped already: that read completes first. Threads
    asking for agent-1's arena meanwhile wait for the one mapping and share it."""
    cluster = make_cluster(2, host_bytes=16 << 20)
    client = make_client(cluster, transports=("shm",))
    client.put("on-0", np.arange(1000, dtype=np.int32), preferred_node="agent-0")
    client.put("on-1", np.arange(2000, dtype=np.int32), preferred_node="agent-1")
    nodes = client.index.nodes()
    slow_name = nodes["agent-1"].shm_name
    client._shm.retain({nodes["agent-0"].shm_name})  # agent-1's arena is to be mapped again
    attaching, release = threading.Event(), threading.Event()
    attaches: list[str] = []
    real_attach = SharedSegment.attach

    def held_attach(name: str, size_bytes: int, *, populate: bool = True) -> SharedSegment:
        attaches.append(name)
        if name == slow_name:
            attaching.set()
            release.wait(30)
        return real_attach(name, size_bytes, populate=populate)

    monkeypatch.setattr(host_module.SharedSegment, "attach", staticmethod(held_attach))
    slow_results: list[object] = []
    slow = [threading.Thread(target=lambda: slow_results.append(client.get("on-1"))) for _ in range(3)]
    for thread in slow:
        thread.start()
    try:
        assert attaching.wait(30)
        fast_done = threading.Event()
        fast = threading.Thread(target=lambda: (client.get("on-0"), fast_done.set()))
        fast.start()
        assert fast_done.wait(30), "a read from an arena already mapped waited for another arena's mapping"
        fast.join(30)
    finally:
        release.set()
        for thread in slow:
            thread.join(30)
    assert attaches.count(slow_name) == 1  # one mapping, shared by the three readers
    assert len(slow_results) == 3 and all(np.array_equal(r, np.arange(2000, dtype=np.int32)) for r in slow_results)


def test_a_read_whose_arena_is_unmapped_under_it_reads_the_next_replica(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's node-table refresh unmaps an arena (its agent left the table) between the
    read's lookup of the mapping and its copy: the read used to fail with "segment ... is closed"
    although the object has a replica elsewhere. The unmap is placed at that point by a wrapper
    around SharedSegment.view that runs it first, once."""
    cluster = make_cluster(2, host_bytes=16 << 20)
    client = make_client(cluster, transports=("shm",))
    value = np.arange(4096, dtype=np.int64)
    client.put("two", value, replicas=2)
    nodes = client.index.nodes()
    names = {nodes["agent-0"].shm_name, nodes["agent-1"].shm_name}
    real_view = SharedSegment.view
    unmapped: list[str] = []

    def view_after_an_unmap(self: SharedSegment, offset: int, length: int) -> memoryview:
        if not unmapped and self.name in names:
            unmapped.append(self.name)
            client._shm.retain(names - {self.name})
        return real_view(self, offset, length)

    monkeypatch.setattr(host_module.SharedSegment, "view", view_after_an_unmap)
    assert np.array_equal(client.get("two"), value)
    assert len(unmapped) == 1
