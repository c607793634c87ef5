"""Connections to an agent that left: a client's and an agent's pools kept them open (half closed,
CLOSE_WAIT) for the life of the process, up to 2 x tcp_connections per departed agent, so a
long-lived client or an agent through rolling restarts gathered descriptors without bound. Both
now close the pools of endpoints the node table no longer lists when they next read it."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until

from mooncake_store import Client, connect
from mooncake_store.agent import pressure as pressure_module
from mooncake_store.agent.node import Agent
from mooncake_store.client import node_view
from mooncake_store.client.node_view import NODE_TABLE_TTL_S

MiB = 1 << 20


def sockets_to(port: int) -> int:
    """Sockets of this process whose remote end is ``port`` on loopback, in any state."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                count += 1
    return count


def _port(agent: Agent) -> int:
    return int(agent.server.endpoint.rsplit(":", 1)[1])


def test_a_client_closes_its_connections_to_an_agent_that_left(
    make_peer_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    stays = make_peer_agent(host_bytes=8 * MiB)
    leaves = make_peer_agent(host_bytes=8 * MiB)
    client = clients(stays, transports=("tcp",))
    value = np.arange(MiB, dtype=np.uint8)
    client.put("on-leaver", value, preferred_node=leaves.node_id)
    client.put("on-stayer", value, preferred_node=stays.node_id)
    assert np.array_equal(client.get("on-leaver"), value)
    port = _port(leaves)
    assert sockets_to(port) >= 1, "the client pooled no connection to the agent"
    leaves.stop()  # leaves the node table
    # The client's next read of the table (at most NODE_TABLE_TTL_S old) lets the pool go.
    assert wait_until(
        lambda: np.array_equal(client.get("on-stayer"), value) and sockets_to(port) == 0, 5 + 3 * NODE_TABLE_TTL_S
    ), f"{sockets_to(port)} connection(s) to the departed agent are still open"


def test_an_agent_closes_its_spill_connections_to_a_peer_that_left(
    make_peer_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    spills = make_peer_agent(host_bytes=4 * MiB, real_pressure=True, pressure_interval_s=0.02, spill_shm=False)
    leaves = make_peer_agent(host_bytes=16 * MiB)
    client = clients(spills, transports=("shm",))
    for i in range(4):  # past the high watermark: the coldest go to the peer, over TCP
        client.put(f"k{i}", np.full(MiB, i, np.uint8), preferred_node=spills.node_id)
    assert wait_until(lambda: len(leaves.table) > 0, 10), "nothing was spilled to the peer"
    port = _port(leaves)
    assert sockets_to(port) >= 1, "the spill pooled no connection to the peer"
    leaves.stop()
    assert wait_until(lambda: sockets_to(port) == 0, 5 + 3 * pressure_module.RETAIN_EVERY_S), (
        f"{sockets_to(port)} connection(s) to the departed peer are still open"
    )


def _maps_of(shm_name: str) -> int:
    """Mappings of this process whose file is the segment ``shm_name`` (deleted or not)."""
    return sum(shm_name in line for line in Path("/proc/self/maps").read_text().splitlines())


def _read_from_a_leaver(
    make_peer_agent: Callable[..., Agent], clients: Callable[..., Client], transport: str
) -> tuple[Client, Agent]:
    """A client (of ``transport`` only) that has put an object on an agent about to leave and read
    it back, so that it maps that agent's arena or pools a connection to it; and that agent."""
    stays = make_peer_agent(host_bytes=8 * MiB)
    leaves = make_peer_agent(host_bytes=8 * MiB)
    client = clients(stays, transports=(transport,))
    value = np.arange(MiB, dtype=np.uint8)
    client.put("on-leaver", value, preferred_node=leaves.node_id)
    assert np.array_equal(client.get("on-leaver"), value)
    return client, leaves


def test_a_client_gone_quiet_unmaps_the_arena_of_an_agent_that_stopped(
    make_peer_agent: Callable[..., Agent], clients: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mappings of departed agents were released only by a read of the node table, which only gets
    and puts make: a client that went quiet, or made only index calls (exists here), kept a
    stopped agent's whole arena allocated in /dev/shm after its file was unlinked, for good (and
    with an arena over half of /dev/shm, that agent could not start again). Its own thread now
    sees the file gone and reads the table."""
    monkeypatch.setattr(node_view, "RETAIN_EVERY_S", 0.2)
    client, leaves = _read_from_a_leaver(make_peer_agent, clients, "shm")
    name = leaves.arena.name
    assert _maps_of(name) >= 1, "the client did not map the agent's arena"
    leaves.stop()  # unlinks its arena's file and leaves the node table
    assert wait_until(lambda: not client.exists("on-leaver") and _maps_of(name) == 0, 5), (
        f"the client still maps {name} ({_maps_of(name)} mapping(s)) with no get or put since the agent stopped"
    )


def test_a_client_gone_quiet_closes_its_connections_to_an_agent_that_left(
    make_peer_agent: Callable[..., Agent], clients: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same over TCP, where no file tells: a quiet client reads the table every REFRESH_EVERY_S
    while it pools connections."""
    monkeypatch.setattr(node_view, "RETAIN_EVERY_S", 0.2)
    monkeypatch.setattr(node_view, "REFRESH_EVERY_S", 0.5)
    _client, leaves = _read_from_a_leaver(make_peer_agent, clients, "tcp")  # kept: a dropped client closes its pools
    port = _port(leaves)
    assert sockets_to(port) >= 1, "the client pooled no connection to the agent"
    leaves.stop()
    assert wait_until(lambda: sockets_to(port) == 0, 5), (
        f"{sockets_to(port)} connection(s) to the departed agent are still open in a quiet client"
    )


def test_a_client_dropped_without_close_is_not_kept_alive_by_its_own_thread(
    make_peer_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread that releases departed agents must hold the client weakly: a client dropped
    without close() is collected (its sockets and mappings with it), and the thread ends."""
    monkeypatch.setattr(node_view, "RETAIN_EVERY_S", 0.1)
    agent = make_peer_agent(host_bytes=8 * MiB)
    before = set(threading.enumerate())
    client = connect(agent.index.url, namespace=agent.namespace)
    client.put("k", np.arange(1000, dtype=np.uint8))
    assert np.array_equal(client.get("k"), np.arange(1000, dtype=np.uint8))  # a table read: the thread starts
    janitors = [t for t in set(threading.enumerate()) - before if t.name == "mc-node-view"]
    assert len(janitors) == 1
    dropped = weakref.ref(client)
    del client
    # A collection while the thread looks (it holds the view for that moment) misses it: again.
    assert wait_until(lambda: gc.collect() >= 0 and dropped() is None, 5), (
        "the client was kept alive after it was dropped"
    )
    assert wait_until(lambda: not janitors[0].is_alive(), 5), "its thread outlived the client"
