"""Review of the FENCE / UNFENCE ops (agent/server.py _fence, _unfence, the idle poll of _serve;
transport/tcp.py PeerConnections.fenced). Each test names the bug it proves and fails on that code.

Real AgentServer over a real Agent's arena and allocation table, real sockets, the real client.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from mooncake_store.agent.node import Agent
from mooncake_store.agent.server import AgentServer
from mooncake_store.errors import MooncakeError
from mooncake_store.transport.tcp import PeerConnections

KiB = 1 << 10
MiB = 1 << 20
SIZE = 256 * KiB


def test_bug1_fence_lifted_by_the_idle_timer_while_the_writer_still_copies(
    make_inproc_agent: Callable[..., Agent],
) -> None:
    """A same-host writer FENCEs, then memcpys for longer than the agent's timeout_s (a big batch
    into a sparse mapping, the process descheduled). The agent's idle poll closes the connection
    and lifts the fence although the writer is alive and still copying; a free then releases the
    block at once and the next reserve re-grants it, so the writer's bytes land in another object's
    block. While FENCE is outstanding (no UNFENCE, the connection open), a free must only doom."""
    agent = make_inproc_agent(host_bytes=4 * MiB, reserve_timeout_s=60.0)
    # The Agent builds its server with timeout_s=30; a second real server over the same arena and
    # table with 0.5 s shows the same thing without waiting 30 s.
    server = AgentServer("127.0.0.1:0", agent.arena, agent.table, timeout_s=0.5, hooks=agent)
    server.start()
    peer = PeerConnections(server.endpoint, timeout_s=5.0, max_idle=2)
    seen: dict[str, object] = {}
    try:
        (res,) = peer.reserve([(SIZE, b"\x01" * 16)], node_id=agent.node_id)

        def work(fenced: list[bool]) -> list[bool]:
            seen["fenced"] = list(fenced)
            time.sleep(1.5)  # the writer is slow, not dead: it still holds the connection
            # The peer's sync frees the reservation meanwhile (it timed out, or was revoked).
            agent.table.free([res.alloc_id])
            seen["still_held"] = res.alloc_id in agent.table
            (other,) = agent.table.reserve([(SIZE, b"\x02" * 16)]) or [None]
            seen["regranted"] = other is not None and other.offset == res.offset
            if other is not None:
                agent.arena.view(other.offset, SIZE)[:] = b"\x22" * SIZE  # the new object's bytes
            # ... and the writer's memcpy, still under what it believes is a fence, goes on.
            agent.arena.view(res.offset, SIZE)[:] = b"\xaa" * SIZE
            return [True]

        with contextlib.suppress(MooncakeError):  # UNFENCE finds the connection closed
            peer.fenced([res.alloc_id], agent.arena.name, work)
        assert seen["fenced"] == [True]
        assert seen["still_held"], "a free of a fenced reservation released it: the fence was lifted by a timer"
        assert not seen["regranted"], "the fenced block was re-granted while its writer was still copying into it"
    finally:
        peer.close()
        server.stop()
