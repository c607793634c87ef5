"""Second look at session 5's change (b651c1c..HEAD): defects the fixes themselves left or made.

Each test fails on the code as reviewed, for the reason its docstring gives. Real components only:
the session's embedded Valkey, real Agent objects in this process (their servers, arenas and index
scripts), real clients.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis
from helpers import count_read_requests, random_bytes, replicas_of, stop_process, wait_until

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.agent.node import Agent
from mooncake_store.client.cluster import AgentProcess
from mooncake_store.embedded import EmbeddedServer
from mooncake_store.errors import TransferError

KiB = 1 << 10
SIZE = 256 * KiB


def failures_of(obj: Any, name: str) -> list[Exception]:
    """Spy (calling through) on ``obj.name``: each exception a call raised, appended to the returned
    list. Shows that a loop met an injected index fault, so a check that it survived is not run
    before the fault was ever hit (on a loaded machine the loop may not have run in a fixed wait)."""
    failed: list[Exception] = []
    real = getattr(obj, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        except Exception as exc:
            failed.append(exc)
            raise

    setattr(obj, name, spy)
    return failed


@pytest.fixture
def index_fault(redis_server: EmbeddedServer) -> Iterator[Callable[[str | None], None]]:
    """``index_fault("oom")``: the server refuses writes with OOM (maxmemory 1 B, noeviction), as a
    Redis at its memory limit does; ``index_fault("readonly")``: it refuses every write with
    READONLY, as a demoted master does during a failover (REPLICAOF a port where nothing listens:
    no sync ever starts, so its data stays); ``index_fault(None)`` ends either. The server's
    settings are put back at the end of the test whatever happened."""
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    saved = {name: r.config_get(name)[name] for name in ("maxmemory", "maxmemory-policy")}

    def fault(kind: str | None) -> None:
        if kind == "oom":
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", 1)
        elif kind == "readonly":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            r.replicaof("127.0.0.1", port)
        else:
            r.config_set("maxmemory", saved["maxmemory"])
            r.replicaof("NO", "ONE")

    try:
        yield fault
    finally:
        r.replicaof("NO", "ONE")
        for name, value in saved.items():
            r.config_set(name, value)
        r.close()


def test_a_transient_index_error_in_the_heartbeat_does_not_free_the_agents_objects(
    make_inproc_agent: Callable[..., Agent], index_fault: Callable[[str | None], None]
) -> None:
    """node.py _heartbeat_loop: commit 4b0481b moved the takeover case (IN_USE) into its own
    ``except NodeIdTaken`` branch, but left the old ``except MooncakeError`` branch, with its comment
    about IN_USE, still calling _drop_everything(). What reaches it now is any script error from the
    heartbeat or the reaper: here the index at its memory limit (OOM) for a moment. The agent then
    frees every committed object while the index still names them on a live node (its record and
    deadline are untouched: the next heartbeat succeeds), and the next put gets the block: a
    same-host reader of the old key copies the new object's bytes (DESIGN.md §3.3)."""
    agent = make_inproc_agent(heartbeat_interval_s=0.05, heartbeat_ttl_s=60.0, host_bytes=4 << 20)
    client = connect(agent.index.url, namespace=agent.namespace, transports=("shm",))
    try:
        value = random_bytes(SIZE, 1)
        client.put("kept", value)
        agent.sync_once()  # the commit's ack: the agent holds "kept" as COMMITTED (its sync loop is manual here)
        (replica,) = replicas_of(agent, "kept")
        assert replica.alloc_id in agent.table

        failed_beats = failures_of(agent.index, "heartbeat")
        index_fault("oom")
        # Two heartbeats (every 50 ms) meet the OOM error: the loop handled the first one before it
        # made the second. Waited for, not a fixed time: on a loaded machine none may run in that.
        wait_until(lambda: len(failed_beats) >= 2 or replica.alloc_id not in agent.table, timeout_s=15.0)
        index_fault(None)
        assert failed_beats, "no heartbeat met the OOM error: the case under test never happened"
        assert client.get("kept") is not None  # the index still names it on a live node
        client.put("newcomer", np.full(SIZE, 0x5A, np.uint8))
        got = client.get("kept")
        assert got.tobytes() == value.tobytes(), (
            "after one failed heartbeat the agent freed 'kept' while the index still names it; the "
            f"next put took its block (newcomer at {replicas_of(agent, 'newcomer')[0].offset}, kept "
            f"at {replica.offset}) and a reader of 'kept' got the newcomer's bytes"
        )
        assert replica.alloc_id in agent.table, "the agent dropped a committed object the index still names"
        # Dropped objects stay in the table, doomed and held (drop_after_reap): not dooming is the point.
        assert replica.alloc_id in agent.table.committed_ids(), "the agent doomed an object the index still names"
    finally:
        client.close()


def test_get_many_into_fills_the_rows_of_one_array(shared_client: Client) -> None:
    """client.py get_many_into (commit 45fd4c3) now refuses ``outs`` that is not a
    collections.abc.Sequence: a 2-D numpy array (one row per key, the natural staging for a batch of
    equal chunks) was filled row by row before and is now InvalidValue, although each row is a
    writable C-contiguous buffer that get_into takes. The check was meant for a str or bytes."""
    keys = [f"second-look/rows/{i}" for i in range(3)]
    values = [random_bytes(4 * KiB, 10 + i) for i in range(3)]
    shared_client.put_many(dict(zip(keys, values, strict=True)))
    try:
        outs = np.zeros((3, 4 * KiB), np.uint8)
        assert shared_client.get_many_into(keys, outs) == [4 * KiB] * 3
        for row, value in zip(outs, values, strict=True):
            assert row.tobytes() == value.tobytes()
    finally:
        shared_client.remove_many(keys)


def test_a_batch_read_waits_for_a_stalled_agent_once_even_without_other_replicas(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """README (Architecture): "A batch read that meets a stalled agent tries its other keys'
    replicas elsewhere first, so the batch waits for it once, not once per key." gets.py (commit
    e3d7403) only sorts the failing endpoint last (_read_object's ``failing``); a key whose only
    replica is there (replicas=1, the default) is still asked, one more timeout per key: a batch of
    three keys waits four timeouts per attempt, and max_retries more attempts each do it again.
    Counted through a spy that calls through (not timed)."""
    cluster = make_cluster(1, heartbeat_ttl_s=60.0)
    writer = make_client(cluster)
    keys = [f"stalled/{i}" for i in range(3)]
    writer.put_many({k: np.full(16 * KiB, i, np.uint8) for i, k in enumerate(keys)})
    stalled: AgentProcess = cluster.agents[0]
    reader = make_client(cluster, transports=("tcp",), timeout_s=0.5, max_retries=0)
    peer = reader._tcp.peer(stalled.endpoint)
    asked = count_read_requests(peer)
    stop_process(stalled.pid)  # every thread stopped: none answers a request sent from here on
    try:
        with pytest.raises(TransferError):
            reader.get_many(keys)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    assert asked, "the stalled agent was never asked: the case under test never happened"
    assert len(asked) <= 2, f"the stalled agent was asked {len(asked)} times (one timeout each) for {len(keys)} keys"


def test_the_sync_loop_survives_a_transient_index_error(
    make_inproc_agent: Callable[..., Agent], index_fault: Callable[[str | None], None]
) -> None:
    """node.py _sync_loop catches only ConnectError and NodeSuperseded: a script error (READONLY
    here, from a master demoted in a failover; BUSY alike) ends the mc-sync thread for good, and
    with it every ack, every grave and every reclaim of this agent. Commit 45fd4c3 made
    the pressure loop survive such errors; the sync loop (and the heartbeat loop, above) did not
    get the same treatment. Ends the thread on the code as reviewed."""
    agent = make_inproc_agent(sync_interval_s=0.05)
    (sync_thread,) = [t for t in agent._threads if t.name == "mc-sync"]
    failed_syncs = failures_of(agent.index, "agent_sync")
    index_fault("readonly")  # agent_sync's first write (DEL acksout:) is refused
    try:
        # Until the loop has met the fault twice (it survived the first), or its thread ended.
        # Waited for, not a fixed time: on a loaded machine no sync may run in that.
        wait_until(lambda: len(failed_syncs) >= 2 or not sync_thread.is_alive(), timeout_s=15.0)
    finally:
        index_fault(None)
    assert failed_syncs, "no agent_sync call met the READONLY error: the case under test never happened"
    assert sync_thread.is_alive(), "the agent's sync thread ended on one failed agent_sync call"
