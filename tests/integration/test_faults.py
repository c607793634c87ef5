"""Crashes: a writer killed mid-put, an agent killed with its data, an agent stopped cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import stop_process, wait_until

from mooncake_store import Client, ConnectError, KeyNotFound, LocalCluster, MooncakeError, TransferError
from mooncake_store.client import node_view
from mooncake_store.tiers.host import SHM_DIR, namespace_prefix

# The writer runs the real put path up to the bytes (reserve on the agent, PENDING record in the
# index, bytes written), says so, and waits to be killed before it commits.
WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from mooncake_store import connect

    client = connect(sys.argv[1], namespace=sys.argv[2], transports=(sys.argv[3],))
    (plan,) = client._puts.plan({"doomed": np.full(8 << 20, 7, dtype=np.uint8)}, chain_pos=None, chain_parent=None)
    nodes = client._puts.reserver.reserve([plan], 1, None)
    client.index.put_start([plan.pending()], ttl_ms=60000)
    for r in plan.replicas:
        client._puts.writes.write_replica(nodes[r.node_id], r, plan)
    print("RESERVED", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_writer_killed_between_reserve_and_commit(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], transport: str
) -> None:
    cluster = make_cluster(1, reserve_timeout_s=1.0)
    client = make_client(cluster)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, cluster.redis_url, cluster.namespace, transport],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()
        assert line.strip() == b"RESERVED", writer.stderr.read() if writer.stderr else b""
        # The space is taken while the writer lives (the heartbeat publishes it within a second).
        assert wait_until(lambda: client.stat().used_bytes >= 8 << 20, 5.0)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=10)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        for stream in (writer.stdout, writer.stderr):
            if stream:
                stream.close()
    assert not client.exists("doomed")
    # Reclaimed after the 1 s reservation timeout (plus a sync and a heartbeat to publish it).
    assert wait_until(lambda: client.stat().used_bytes == 0, 6.0)
    assert not client.exists("doomed")
    with pytest.raises(KeyNotFound):
        client.get("doomed")
    # The space is usable again: a put of all the arena keeps (under its high watermark) fits.
    client.put("after", np.ones(56 << 20, dtype=np.uint8))
    assert client.get("after").sum() == 56 << 20


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_agent_killed_single_replica_fails_cleanly(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], transport: str
) -> None:
    cluster = make_cluster(2, heartbeat_ttl_s=1.5)
    client = make_client(cluster, transports=(transport,), timeout_s=3.0)
    for i in range(10):
        client.put(f"on-a0/{i}", np.full(1 << 16, i, np.uint8), preferred_node="agent-0")
    victim = cluster.agent("agent-0")
    victim.kill()
    start = time.monotonic()
    # Within the deadline a get may still be served from the dead agent's leftover segment (shm) or
    # fail to connect (tcp); after it, the index no longer returns the replicas at all.
    for i in range(10):
        try:
            got = client.get(f"on-a0/{i}")
            assert int(got[0]) == i  # never wrong bytes
        except (KeyNotFound, TransferError):
            pass
    assert wait_until(lambda: not client.exists("on-a0/0"), 5.0)
    for i in range(10):
        with pytest.raises(KeyNotFound):
            client.get(f"on-a0/{i}")
    assert time.monotonic() - start < 15.0  # no hang past the timeouts
    # The reaper (run by the surviving agent) removes the dead node and its records.
    assert wait_until(lambda: "agent-0" not in client.index.nodes(), 8.0)
    assert client.index.list_keys("on-a0/*") == []


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_agent_killed_two_replicas_lose_nothing(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], transport: str
) -> None:
    cluster = make_cluster(2, heartbeat_ttl_s=1.5)
    writer = make_client(cluster)
    values = {f"r2/{i}": np.random.default_rng(i).integers(0, 255, 100_000, dtype=np.uint8) for i in range(20)}
    writer.put_many(values, replicas=2)
    cluster.agent("agent-1").kill()
    if transport == "shm":
        # A killed agent's segment would still serve shm readers; remove it as a host failure would.
        (SHM_DIR / cluster.agent("agent-1").shm_name).unlink(missing_ok=True)
    reader = make_client(cluster, transports=(transport,), timeout_s=3.0)
    for _ in range(2):  # before and after the heartbeat deadline
        for key, value in values.items():
            assert np.array_equal(reader.get(key), value)
        time.sleep(2.0)
    assert all(r.node_id == "agent-0" for r in reader.index.lookup(["r2/0"], lease_ms=0).objects[0].replicas)  # type: ignore[union-attr]


def test_agent_sigterm_deregisters_and_removes_segment(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(2)
    client = make_client(cluster)
    client.put("leaving", b"bye", preferred_node="agent-1")
    agent = cluster.agent("agent-1")
    segment = Path(SHM_DIR / agent.shm_name)
    assert segment.exists()
    agent.process.send_signal(signal.SIGTERM)
    assert agent.process.wait(timeout=10) == 0
    assert not segment.exists()
    assert "agent-1" not in client.index.nodes()
    assert not client.exists("leaving")


def test_node_id_held_by_live_agent_is_refused(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(1)
    with pytest.raises(MooncakeError, match="is held by a live agent"):
        cluster.add_agent(node_id="agent-0")


def test_agent_that_cannot_listen_exits_and_leaves_no_segment(make_cluster: Callable[..., LocalCluster]) -> None:
    import socket

    cluster = make_cluster(0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(MooncakeError, match=f"cannot listen on 127.0.0.1:{port}") as refused:
            cluster.add_agent(node_id="busy", extra_args=["--listen", f"127.0.0.1:{port}"])
    assert "that port is taken: choose another port, or port 0" in str(refused.value), refused.value
    assert not [p for p in SHM_DIR.iterdir() if p.name.startswith(namespace_prefix(cluster.namespace) + "busy.")]


def test_an_address_not_of_this_host_is_refused_with_advice_that_fits(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """An agent told to listen on an address this host does not have (192.0.2.1, TEST-NET-1: no
    packet is sent, the bind fails) exits naming it. Its advice was "choose another address, or
    port 0 to have a free one picked", with the port already 0."""
    cluster = make_cluster(0)
    with pytest.raises(MooncakeError, match=r"cannot listen on 192\.0\.2\.1:0") as refused:
        cluster.add_agent(node_id="elsewhere", extra_args=["--listen", "192.0.2.1:0"])
    message = str(refused.value)
    assert "192.0.2.1 is not an address of this host" in message and "port 0" not in message, message


def test_a_put_whose_agent_dies_after_its_reserve_lands_on_another_node(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The agent that granted a put's room dies before the bytes arrive (SIGKILL by its PID between
    RESERVE and WRITE, placed by a wrapper around the client's TCP write that kills first and then
    calls the real write). The node table still lists it until its heartbeat deadline; the put
    used to fail with the transfer error. It now places the object on the other node, and what is
    stored reads back whole; a put pinned to the dead node still fails with the transfer error."""
    cluster = make_cluster(2, heartbeat_ttl_s=30.0)
    client = make_client(cluster, transports=("tcp",), timeout_s=3.0)
    value = np.random.default_rng(5).integers(0, 255, 1 << 20, dtype=np.uint8)
    client.put("warm", b"x")  # the node table and the connections in place
    tcp = client._tcp
    real_write = tcp.write_from
    killed: list[str] = []

    def kill_then_write(endpoint: str, *args: object, **kwargs: object) -> object:
        if not killed:
            victim = next(a for a in cluster.agents if a.endpoint == endpoint)
            killed.append(victim.node_id)
            victim.kill()
        return real_write(endpoint, *args, **kwargs)  # type: ignore[arg-type]

    tcp.write_from = kill_then_write  # type: ignore[method-assign]
    client.put("moved-on", value)
    assert killed, "the put never wrote over TCP"
    meta = client.object_meta("moved-on")
    assert meta is not None and [r.node_id for r in meta.replicas] != killed
    assert np.array_equal(client.get("moved-on"), value)
    # Pinned to the node that is gone: nowhere else to go, the connection's error is the answer
    # (it was "has no room", after waiting out timeout_s for room on a node that was not there).
    with pytest.raises(ConnectError, match=f"preferred_node '{killed[0]}'"):
        client.put("pinned-to-the-dead", value, preferred_node=killed[0])
    assert not client.exists("pinned-to-the-dead")
    # And with no node left that answers, an unpinned put says so too.
    survivor = next(a for a in cluster.agents if a.node_id != killed[0])
    survivor.kill()
    with pytest.raises(ConnectError, match="no node could take key 'nowhere'"):
        client.put("nowhere", value)


def test_a_put_whose_first_choice_hangs_goes_to_the_live_nodes(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A put whose reservation waited out its timeout on a hung agent (SIGSTOP, by its PID) placed
    the object again by the node table read before that wait, at a later clock: every row's
    deadline had passed, and it failed with "no live agent is registered" while two agents were
    up with room. It is placed by a table read after the wait now."""
    cluster = make_cluster(3, heartbeat_ttl_s=2.0)
    filler = make_client(cluster)
    for node in ("agent-0", "agent-2"):  # the hung agent is the emptiest: ranked first
        filler.put(f"fill-{node}", np.zeros(24 << 20, np.uint8), preferred_node=node)
    hung = cluster.agent("agent-1")
    client = make_client(cluster, timeout_s=3.0)

    def fills_published() -> bool:
        # The table read before the hang (as a busy client's table would be) must show both fills,
        # or agent-1 is not ranked first and the put never waits on it: waited for, not slept.
        table = client._node_table(refresh=True)
        return all(table[n].tiers[0].used_bytes >= 24 << 20 for n in ("agent-0", "agent-2"))

    assert wait_until(fills_published, 15.0), "no heartbeat published the fills"
    # Which node the put gave up on and what it said: the hang path must be the one taken.
    reserver = client._puts.reserver
    real_elsewhere = reserver._reserve_elsewhere
    gave_up_on: list[tuple[str, str]] = []

    def spy_elsewhere(group: object, nodes: object, failed_node: str, *args: object, **kwargs: object) -> object:
        gave_up_on.append((failed_node, type(kwargs.get("refusal")).__name__))
        return real_elsewhere(group, nodes, failed_node, *args, **kwargs)  # type: ignore[arg-type]

    reserver._reserve_elsewhere = spy_elsewhere  # type: ignore[method-assign]
    stop_process(hung.process.pid)
    try:
        value = np.arange(1 << 20, dtype=np.uint8)
        client.put("past-the-hung", value, replicas=2)
        assert "agent-1" in [node for node, _ in gave_up_on], f"the put never waited on the hung agent: {gave_up_on}"
        meta = client.object_meta("past-the-hung")
        assert meta is not None and sorted(r.node_id for r in meta.replicas) == ["agent-0", "agent-2"]
        assert np.array_equal(client.get("past-the-hung"), value)
    finally:
        os.kill(hung.process.pid, signal.SIGCONT)


def test_a_put_judged_on_a_cached_node_table_reads_it_again_before_giving_up(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client caches the node table for a while, and agents heartbeat about as often: rows a
    little older than their node's last heartbeat looked past their deadlines, and replicas=2 puts
    failed at once ("needs 2 live nodes ... only 1 qualify") with every agent up. Here the cache
    is made to outlive the deadlines outright; the put reads the table again and goes through."""
    monkeypatch.setattr(node_view, "NODE_TABLE_TTL_S", 60.0)
    cluster = make_cluster(2, heartbeat_ttl_s=2.0)
    client = make_client(cluster)
    client._node_table(refresh=True)
    time.sleep(2.5)  # every cached row is past its deadline; the agents heartbeat on
    client.put("cached-table", b"abc", replicas=2)
    meta = client.object_meta("cached-table")
    assert meta is not None and len(meta.replicas) == 2
