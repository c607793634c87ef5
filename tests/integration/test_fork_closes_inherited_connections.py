"""A forked child closes its copies of the client's connections to agents. Kept, a child that
lived on (a worker that never touched the client) held a connection its parent then used: when
the parent died mid-put the agent never saw that connection close, and the fence taken on it held
the put's reservation for as long as the child lived (a probe: 5 of 6 trials, 32 MiB held). Here
the parent closes its client while the child lives: its connections must close at the agent."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import numpy as np
from helpers import socket_fds, tcp_sockets, wait_until

from mooncake_store import Client, LocalCluster
from mooncake_store.transport.tcp import parse_endpoint

ESTABLISHED = "01"


def test_a_forked_child_holds_no_connection_of_its_parents_client(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1, host_bytes=16 << 20)
    client = make_client(cluster, transports=("tcp",))
    client.put("fork-conn/k", np.arange(1024, dtype=np.uint8))  # a pooled connection to the agent
    agent_port = parse_endpoint(cluster.agents[0].endpoint)[1]
    ours = set(socket_fds("self"))
    conns = [s.inode for s in tcp_sockets() if s.inode in ours and s.remote_port == agent_port]
    assert conns, "the client's connection to the agent"
    pid = os.fork()
    if pid == 0:  # a child that lives on and never touches the client
        time.sleep(30)
        os._exit(0)
    try:
        client.close()

        def closed_at_the_agent() -> bool:
            return not any(s.inode in conns and s.state == ESTABLISHED for s in tcp_sockets())

        assert wait_until(closed_at_the_agent, 10.0), "the child kept the parent's connections open"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
