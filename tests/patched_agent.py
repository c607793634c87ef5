"""Agent processes with some of their module constants set in that process before the agent's
own main() runs (the connection limit, timeouts, socket buffers, the refusal limits, the
descriptor limit), so that limits are reached in seconds instead of minutes. Nothing of the agent
is replaced: its real server runs with other numbers. The fixture ``start_agent`` is in
tests/integration/conftest.py."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from helpers import socket_fds, tcp_sockets

from mooncake_store import LocalCluster
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op
from mooncake_store.transport.tcp import parse_endpoint

#: Runs the agent's own main() after setting, in the agent process, what the JSON in argv[1] asks:
#: constants of agent/server.py, agent/ops.py and agent/refusals.py, the server's timeout (``timeout_s``) and
#: the soft descriptor limit (``nofile``).
PATCHED_MAIN = """
import json, resource, sys
patch = json.loads(sys.argv[1])
from mooncake_store.agent import ops, refusals, server
for name, value in patch.items():
    # Each in the module that holds it (server, ops or refusals).
    for module in (server, ops, refusals):
        if hasattr(module, name):
            setattr(module, name, value)
if "timeout_s" in patch:
    _init = server.AgentServer.__init__
    def _patched(self, *args, **kwargs):
        kwargs["timeout_s"] = patch["timeout_s"]
        _init(self, *args, **kwargs)
    server.AgentServer.__init__ = _patched
if "nofile" in patch:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (patch["nofile"], hard))
from mooncake_store.agent.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


class PatchedCluster(LocalCluster):
    """One agent subprocess, started through PATCHED_MAIN with ``patch``."""

    def __init__(self, patch: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(1, **kwargs)
        self.patch = patch

    def agent_command(self, node_id: str, zone: str | None, extra: list[str]) -> list[str]:
        cmd = super().agent_command(node_id, zone, extra)
        assert cmd[1:3] == ["-m", "mooncake_store.agent"], cmd[:3]
        return [cmd[0], "-c", PATCHED_MAIN, json.dumps(self.patch), *cmd[3:]]


def agent_address(cluster: LocalCluster) -> tuple[str, int]:
    """(host, port) of the cluster's first agent."""
    return parse_endpoint(cluster.agents[0].endpoint)


def agent_side_sockets(cluster: LocalCluster, states: tuple[str, ...] = ("01", "08")) -> int:
    """TCP sockets whose local end is the first agent's port, in ``states`` (/proc/net/tcp codes:
    01 ESTABLISHED, 06 TIME_WAIT, 08 CLOSE_WAIT, a socket the peer closed and the agent has not):
    by default the agent's served connections, leaked or not."""
    port = agent_address(cluster)[1]
    return sum(1 for s in tcp_sockets() if s.local_port == port and s.state in states)


def agent_port_fds(cluster: LocalCluster) -> int:
    """Descriptors the first agent holds for TCP sockets on its own port (the served and refused
    connections and the listener): counted by socket inode, so that a Redis connection the agent
    opens or closes meanwhile on its own (its pool grows when two of its threads run a script at
    once, as they do more often under load) does not count."""
    port = agent_address(cluster)[1]
    on_port = {s.inode for s in tcp_sockets() if s.local_port == port}
    return sum(1 for inode in socket_fds(cluster.agents[0].pid) if inode in on_port)


def connect_raw(cluster: LocalCluster, timeout_s: float = 5.0) -> socket.socket:
    """A plain socket to the first agent, for frames written by hand."""
    return socket.create_connection(agent_address(cluster), timeout=timeout_s)


def read_reply(sock: socket.socket) -> tuple[int, int, int, int, int]:
    """One reply header: (op, status, a, b, c)."""
    return frames.unpack(frames.recv_exact(sock, frames.HEADER_BYTES))


def wait_committed(cluster: LocalCluster, alloc_id: int, timeout_s: float = 10.0) -> bool:
    """Until the first agent treats ``alloc_id`` as a committed object, which it learns of a put's
    commit at its next sync (0.2 s; later under load, where a fixed sleep fell short). Polled with
    FENCE, which fences a live reservation (lifted again at once by UNFENCE) and not a committed
    object. False if it was still a reservation after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with connect_raw(cluster) as sock:
        while True:
            sock.sendall(frames.pack(Op.FENCE, 1) + frames.pack_ids([alloc_id]))
            count = read_reply(sock)[3]
            if frames.recv_exact(sock, count) == b"\x00":
                return True
            sock.sendall(frames.pack(Op.UNFENCE, 1) + frames.pack_ids([alloc_id]))
            frames.recv_exact(sock, read_reply(sock)[3])
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
