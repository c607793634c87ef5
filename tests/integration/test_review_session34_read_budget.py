"""READs of a disk-tier object decode the whole chunk file and hold it until the reply has gone: a
peer that sent such READs on many connections and read none of the replies made the agent hold
one decoded copy per connection (16 x 32 MiB from a file of about 1 KB: zeros compress), without
bound. They are held within a budget now (agent/read_budget.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from helpers import wait_until

from mooncake_store import connect
from mooncake_store.agent.node import Agent
from mooncake_store.agent.read_budget import READ_BUDGET_BYTES
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op
from mooncake_store.transport.tcp import parse_endpoint

MiB = 1 << 20


def test_unread_reads_of_a_disk_object_are_held_within_the_budget(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    agent = make_inproc_agent(host_bytes=64 * MiB, reserve_timeout_s=5.0, disk_path=str(tmp_path), disk_bytes=256 * MiB)
    client = connect(agent.index.url, namespace=agent.namespace)
    socks: list[socket.socket] = []
    try:
        client.put("cold", np.zeros(32 * MiB, dtype=np.uint8))
        agent.sync_once()
        (victim,) = agent.index.victim_candidates(agent.node_id, "host")
        location = agent.table.offset_of(victim.alloc_id)
        assert location is not None and agent.pressure.moves.demote_to_disk(victim, location[0])
        (meta,) = client.index.lookup(["cold"], lease_ms=0).objects
        assert meta is not None
        (replica,) = [r for r in meta.replicas if r.tier == "disk"]
        budget = agent.server._read_budget
        held: list[int] = []
        for _ in range(16):
            sock = socket.create_connection(parse_endpoint(agent.server.endpoint), timeout=5)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.sendall(frames.pack(Op.READ, 0, replica.alloc_id, 0, 32 * MiB))
            socks.append(sock)  # and never read
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            held.append(budget.held_bytes)
            time.sleep(0.05)
        assert max(held) <= READ_BUDGET_BYTES, max(held)  # 16 x 32 MiB before: 512 MiB
        assert max(held) >= 32 * MiB  # the READs were served, up to the budget
    finally:
        for sock in socks:
            sock.close()
    try:
        assert wait_until(lambda: budget.held_bytes == 0, 60)  # the unread replies fail, the rest are read
        assert np.array_equal(client.get("cold"), np.zeros(32 * MiB, dtype=np.uint8))
    finally:
        client.close()
