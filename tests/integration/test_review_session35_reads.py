"""READs of a disk-tier object that arrive together share one decoded copy, charged to the read
budget once: the two stripes of one object each decoded the whole file and were each charged the
whole object (twice the memory, twice the work, and an object over half the budget read one stripe
after the other). A READ the budget turns away says so, with what is held and the budget, instead
of "no longer holds allocation"."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import TransferError, connect
from mooncake_store.agent.node import Agent
from mooncake_store.agent.read_budget import READ_BUDGET_BYTES, ReadBudget
from mooncake_store.client.client import Client
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status
from mooncake_store.transport.tcp import parse_endpoint
from mooncake_store.types import Replica, TierKind

MiB = 1 << 20


def _put_on_disk(agent: Agent, client: Client, key: str, value: bytes | np.ndarray) -> Replica:
    """``value`` stored under ``key`` and demoted to the agent's disk tier; its disk replica."""
    client.put(key, value)
    agent.sync_once()
    (victim,) = [v for v in agent.index.victim_candidates(agent.node_id, "host") if v.key == key]
    location = agent.table.offset_of(victim.alloc_id)
    assert location is not None and agent.pressure.moves.demote_to_disk(victim, location[0])
    (meta,) = client.index.lookup([key], lease_ms=0).objects
    assert meta is not None
    (replica,) = [r for r in meta.replicas if r.tier == "disk"]
    return replica


def _unread_read(agent: Agent, alloc_id: int, offset: int, length: int) -> socket.socket:
    """A READ sent on a connection of its own whose reply is not read yet (the agent holds the
    object's copy until it has sent it)."""
    sock = socket.create_connection(parse_endpoint(agent.server.endpoint), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.sendall(frames.pack(Op.READ, 0, alloc_id, offset, length))
    return sock


def _reply_of(sock: socket.socket, length: int) -> bytes:
    header = bytearray(frames.HEADER.size)
    view = memoryview(header)
    got = 0
    while got < len(header):
        got += sock.recv_into(view[got:])
    _, _, op, status, _, _, size = frames.HEADER.unpack(header)
    assert (op, status, size) == (Op.READ | frames.REPLY_BIT, Status.OK, length)
    payload = bytearray(length)
    view = memoryview(payload)
    got = 0
    while got < length:
        n = sock.recv_into(view[got:])
        assert n, "agent closed the connection mid-reply"
        got += n
    return bytes(payload)


def test_stripes_of_one_disk_object_share_one_decoded_copy(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    agent = make_inproc_agent(host_bytes=64 * MiB, reserve_timeout_s=5.0, disk_path=str(tmp_path), disk_bytes=256 * MiB)
    client = connect(agent.index.url, namespace=agent.namespace)
    value = np.random.default_rng(35).integers(0, 256, 32 * MiB, dtype=np.uint8)
    half = 16 * MiB
    socks: list[socket.socket] = []
    try:
        replica = _put_on_disk(agent, client, "cold", value)
        reads_before = agent.pressure.counters[TierKind.DISK]["reads"]
        budget = agent.server._read_budget
        socks = [_unread_read(agent, replica.alloc_id, start, half) for start in (0, half)]
        assert wait_until(lambda: budget.held_bytes > 0, 10)
        held: list[int] = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # both READs are in: each stuck sending its reply
            held.append(budget.held_bytes)
            time.sleep(0.02)
        assert max(held) == 32 * MiB, max(held)  # one copy; 64 MiB before, one per stripe
        got = b"".join(_reply_of(sock, half) for sock in socks)
        assert got == value.tobytes()
        assert wait_until(lambda: budget.held_bytes == 0, 10)
        assert agent.pressure.counters[TierKind.DISK]["reads"] == reads_before + 1  # one object read
        assert np.array_equal(client.get("cold"), value)  # and the next READ makes a copy again
    finally:
        for sock in socks:
            sock.close()
        client.close()


@pytest.mark.timeout(120)
def test_a_read_the_budget_turns_away_says_so(make_inproc_agent: Callable[..., Agent], tmp_path: Path) -> None:
    agent = make_inproc_agent(
        host_bytes=192 * MiB, reserve_timeout_s=5.0, disk_path=str(tmp_path), disk_bytes=1024 * MiB
    )
    client = connect(agent.index.url, namespace=agent.namespace, max_retries=0)
    big, other = 160 * MiB, READ_BUDGET_BYTES - 160 * MiB + MiB  # together past the budget
    sock: socket.socket | None = None
    try:
        held_replica = _put_on_disk(agent, client, "held", np.zeros(big, dtype=np.uint8))
        _put_on_disk(agent, client, "other", np.ones(other, dtype=np.uint8))
        sock = _unread_read(agent, held_replica.alloc_id, 0, big)
        assert wait_until(lambda: agent.server._read_budget.held_bytes == big, 10)
        with pytest.raises(TransferError) as caught:
            client.get("other")
        message = str(caught.value)
        assert f"holds {big} B of objects decoded or copied out for READs" in message, message
        assert f"its budget is {READ_BUDGET_BYTES} B" in message, message
    finally:
        if sock is not None:
            sock.close()
    try:
        assert wait_until(lambda: agent.server._read_budget.held_bytes == 0, 30)
        assert np.array_equal(client.get("other"), np.ones(other, dtype=np.uint8))  # nothing lost
    finally:
        client.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_replica_outside_its_arena_sends_the_read_to_the_next_one(
    make_inproc_agent: Callable[..., Agent], transport: str
) -> None:
    """A replica whose offset lies past its agent's arena (a record written by hand or by another
    build) fails as a transfer does, and the read goes on to the next replica. Over shm it was the
    mapping's InvalidValue, which ended the get with the other replica unread."""
    first = make_inproc_agent(node_id="rv-a")
    make_inproc_agent(node_id="rv-b", namespace=first.namespace)
    client = connect(first.index.url, namespace=first.namespace, transports=(transport,))
    value = np.arange(100_000, dtype=np.uint8)
    try:
        client.put("two", value, replicas=2)
        index = client.index
        record = index.prefix + "o:two"
        replicas = json.loads(index.redis.hget(record, "replicas"))
        assert sorted(r[0] for r in replicas) == ["rv-a", "rv-b"]
        for replica in replicas:
            if replica[0] == "rv-a":
                replica[2] = first.arena.size_bytes  # its bytes would end past the arena
        index.redis.hset(record, "replicas", json.dumps(replicas))
        for _ in range(3):  # whichever replica a read ranks first
            assert np.array_equal(client.get("two"), value)
    finally:
        client.close()


def test_a_read_of_an_empty_disk_object_gives_its_reader_back(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """An empty object is charged 0 B, and its READ's reader was given back only for a charge: one
    raw READ of it (this build's client skips them; another's need not) left a reader counted for
    good, and with it every later READ of an object past the budget, which is let through only
    alone, waited out its deadline and was refused. The budget is 1 MiB here, so that an object
    of 2 MiB stands for one past the real 256 MiB."""
    agent = make_inproc_agent(host_bytes=16 * MiB, disk_path=str(tmp_path), disk_bytes=64 * MiB, promote_on_read=False)
    budget = agent.server._read_budget = ReadBudget(limit_bytes=1 * MiB)
    client = connect(agent.index.url, namespace=agent.namespace, transports=("tcp",))
    try:
        big = np.random.default_rng(1).integers(0, 256, 2 * MiB, dtype=np.uint8)
        _put_on_disk(agent, client, "big", big)
        assert np.array_equal(client.get("big"), big)  # alone, it is let through past the budget
        empty = _put_on_disk(agent, client, "empty", b"")
        with socket.create_connection(parse_endpoint(agent.server.endpoint), timeout=10) as sock:
            sock.sendall(frames.pack(Op.READ, 0, empty.alloc_id, empty.offset, 0))
            header = sock.recv(frames.HEADER.size, socket.MSG_WAITALL)
            _, _, op, status, _, _, size = frames.HEADER.unpack(header)
            assert (op, status, size) == (Op.READ | frames.REPLY_BIT, Status.OK, 0)
        # Its reader is given back once the reply has gone, just after the client has it.
        given_back = wait_until(lambda: (budget.held_bytes, budget._readers) == (0, 0), 10)
        assert given_back, (budget.held_bytes, budget._readers)
        assert np.array_equal(client.get("big"), big)  # alone again: let through past the budget
    finally:
        client.close()
