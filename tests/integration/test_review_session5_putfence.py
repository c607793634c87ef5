"""Review of a716e88: same-host client puts copy under the agent's FENCE / UNFENCE
(client/puts.py _put_once, client/replica_writes.py fence, copy_fenced; transport/fence.py Fence,
transport/tcp.py PeerConnections.fenced; agent/ops.py _fence, _unfence). Real in-process Agents, real sockets,
real shm, the real client."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import held_fences, run_in_threads, wait_until

from mooncake_store.agent.node import Agent
from mooncake_store.client.prefix import PrefixCache
from mooncake_store.errors import MooncakeError
from mooncake_store.transport import frames

KiB = 1 << 10
MiB = 1 << 20


def fenced_conns(agent: Agent) -> int:
    return len(agent.server._fences)


def test_zero_size_and_mixed_batch_same_host(make_inproc_agent, clients) -> None:
    agent = make_inproc_agent(host_bytes=8 * MiB, reserve_timeout_s=30.0)
    c = clients(agent, transports=("shm", "tcp"))
    items = {f"k{i}": np.full(i * 100, i, np.uint8) for i in range(20)}  # k0 is empty
    c.put_many(items)
    for k, v in items.items():
        assert np.array_equal(c.get(k), v)
    assert fenced_conns(agent) >= 1, "the same-host put did not go through FENCE"
    assert held_fences(agent) == 0


def test_shm_only_client_puts_same_host(make_inproc_agent, clients) -> None:
    agent = make_inproc_agent(host_bytes=8 * MiB, reserve_timeout_s=30.0)
    c = clients(agent, transports=("shm",))
    data = np.arange(64 * KiB, dtype=np.uint8)
    c.put("a", data)
    assert np.array_equal(c.get("a"), data)
    assert held_fences(agent) == 0


def test_batch_larger_than_max_batch(make_inproc_agent, clients) -> None:
    agent = make_inproc_agent(host_bytes=64 * MiB, reserve_timeout_s=60.0)
    c = clients(agent, transports=("shm", "tcp"))
    n = frames.MAX_BATCH + 10
    items = {f"b{i}": np.full(8, i % 251, np.uint8) for i in range(n)}
    c.put_many(items)
    for i in (0, frames.MAX_BATCH - 1, frames.MAX_BATCH, n - 1):
        assert np.array_equal(c.get(f"b{i}"), items[f"b{i}"])
    assert held_fences(agent) == 0


def test_two_same_host_agents_replicas_2(make_peer_agent, clients) -> None:
    a = make_peer_agent(host_bytes=8 * MiB, spill_to_peers=False)
    b = make_peer_agent(host_bytes=8 * MiB, spill_to_peers=False)
    c = clients(a, transports=("shm", "tcp"))
    items = {f"r{i}": np.full(4 * KiB, i, np.uint8) for i in range(10)}
    c.put_many(items, replicas=2)
    for k, v in items.items():
        assert np.array_equal(c.get(k), v)
    assert len(a.table) == 10 and len(b.table) == 10
    assert held_fences(a) == 0 and held_fences(b) == 0


def test_concurrent_puts_from_many_threads(make_inproc_agent, clients) -> None:
    agent = make_inproc_agent(host_bytes=64 * MiB, reserve_timeout_s=60.0)
    c = clients(agent, transports=("shm", "tcp"))

    def worker(t: int) -> None:
        for i in range(30):
            c.put_many({f"t{t}-{i}-{j}": np.full(16 * KiB, (t + i + j) % 256, np.uint8) for j in range(4)})

    errors = run_in_threads(worker, 16, timeout_s=120)
    assert not errors, errors[:3]
    for t in range(16):
        assert np.array_equal(c.get(f"t{t}-29-3"), np.full(16 * KiB, (t + 29 + 3) % 256, np.uint8))
    assert held_fences(agent) == 0


def _new_reservations(agent: Agent, before: set[int]) -> list[int]:
    return [a for a in agent.table.known_ids() if a not in before]


def test_arena_unreachable_put_goes_over_tcp_without_fences(make_inproc_agent, clients) -> None:
    """The arena file is gone when the client first looks for it: the put goes over TCP (no fence
    is taken), and the object reads back."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=60.0)
    c = clients(agent, transports=("shm", "tcp"))
    value = np.full(64 * KiB, 7, np.uint8)
    path = Path("/dev/shm") / agent.arena.name
    moved = path.with_name(path.name + ".moved")
    os.rename(path, moved)
    try:
        c.put("x", value)
    finally:
        os.rename(moved, path)
    assert fenced_conns(agent) == 0, "a fence was taken for a put that could not map the arena"
    assert np.array_equal(c.get("x"), value)


def test_copy_that_raises_leaves_no_fence(make_inproc_agent, clients, monkeypatch) -> None:
    """The memcpy fails inside the fence (the FENCE was answered, the copy raises): the error is the
    one reported, the client's connection closes and with it the agent lifts the fence."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=60.0)
    c = clients(agent, transports=("shm", "tcp"))
    c.put("warm", np.ones(4 * KiB, np.uint8))  # the arena is mapped: the failure is the copy's
    before = agent.table.known_ids()

    def failing_copy(*args: object, **kwargs: object) -> None:
        assert held_fences(agent) == 1, "the copy ran outside the fence"
        raise OSError("copy failed (injected)")

    monkeypatch.setattr(c._shm, "write_from", failing_copy)
    with pytest.raises(MooncakeError, match="injected"):
        c.put("x", np.full(64 * KiB, 7, np.uint8))
    assert wait_until(lambda: held_fences(agent) == 0, 10), "the agent did not lift the fence"
    left = _new_reservations(agent, before)
    assert left, "the reservation the put made is not in the table"
    agent.table.free(left)
    assert not _new_reservations(agent, before), "a reader/fence count was left on the reservation"


def test_prefix_store_same_host(make_inproc_agent, clients) -> None:
    agent = make_inproc_agent(host_bytes=16 * MiB, reserve_timeout_s=60.0)
    c = clients(agent, transports=("shm", "tcp"))
    cache = PrefixCache(c, "m1", chunk_tokens=4)
    tokens = list(range(16))
    chunks = [np.full(8 * KiB, i, np.uint8) for i in range(4)]
    assert cache.store(tokens, chunks) == 4
    hit = cache.load(tokens)
    try:
        assert hit.num_chunks == 4
        for i, ch in enumerate(hit.chunks):
            assert np.array_equal(np.asarray(ch), chunks[i])
    finally:
        hit.release()
    assert held_fences(agent) == 0
