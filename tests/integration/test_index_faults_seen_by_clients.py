"""The index under faults, as writers and readers meet them: a server restarted empty, a match
cut between its windows, a server at its maxmemory."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import server_at_maxmemory, stop_process

from mooncake_store import Client, LocalCluster, PrefixCache, connect
from mooncake_store.embedded import EmbeddedServer
from mooncake_store.errors import ConnectError, MooncakeError
from mooncake_store.index.client import VANISHED_HOLD_MS
from mooncake_store.index.prefix import PrefixIndex
from mooncake_store.index.schema import BATCH_LIMIT

MiB = 1 << 20


def test_a_put_right_after_the_index_restarts_empty_waits_for_the_node_to_register_again() -> None:
    """An index restarted empty knows no node until each agent's next heartbeat (about a second).
    A put in that window reserved on its agent (alive, in the client's cached table), and its
    commit was refused for a node the table no longer had; the put retried max_retries times at
    once and failed with ReservationExpired, for about a second after every such restart. The
    commit now says GONE, and the put waits for a fresh table, within timeout_s, as it waits for
    room: the first put after the restart is stored and read back."""
    first = EmbeddedServer().start()
    again: EmbeddedServer | None = None
    try:
        with (
            LocalCluster(1, host_bytes=8 << 20, redis_url=first.url, namespace="s22-restart"),
            connect(first.url, namespace="s22-restart", timeout_s=10.0) as writer,
        ):
            writer.put("before", b"A" * 1000)
            os.kill(first.pid, signal.SIGKILL)
            first.stop()
            again = EmbeddedServer(port=first.port).start()  # the same address, empty
            writer.put("after", b"B" * 1000)
            assert bytes(writer.get("after")) == b"B" * 1000
    finally:
        if again is not None:
            again.stop()
        first.stop()


def test_a_match_whose_later_window_fails_leaves_no_pins_behind(
    shared_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PrefixIndex.match pins a chain one window of 4096 chunks per round trip. When a later
    window's round trip failed, the earlier windows' pins stayed for their whole lease (30 s by
    default) with no hit to release them: those chunks could not be evicted or replaced meanwhile.
    The second window's call fails here (a wrapper around the index's script runner raises on it,
    as a server gone between the two would); the first window's pins are lifted before the error
    reaches the caller."""
    cache = PrefixCache(shared_client, f"s22-match-{uuid.uuid4().hex[:6]}/u8/L1/kv1/d1/tp0", chunk_tokens=1)
    tokens = list(range(BATCH_LIMIT + 3))
    assert cache.store(tokens, lambda i: np.full(1, i % 251, np.uint8)) == len(tokens)
    index = PrefixIndex(shared_client.index)
    calls: list[int] = []
    real_run = index._run

    def failing_second_window(name: str, *args: object) -> object:
        if name == "prefix_match":
            calls.append(1)
            if len(calls) == 2:
                raise ConnectError("the index went away between two windows (injected)")
        return real_run(name, *args)

    monkeypatch.setattr(index, "_run", failing_second_window)
    keys = cache.keys(tokens)
    try:
        with pytest.raises(ConnectError, match="injected"):
            index.match(keys, pin_id="s22-pins", lease_ms=60_000)
        assert len(calls) == 2
        still_pinned = sum(1 for count in cache.refcounts(tokens) if count)
        assert still_pinned == 0, f"{still_pinned} chunk(s) stayed pinned after the match failed"
    finally:
        shared_client.remove_many(keys)
        cache.close()


def test_a_get_refused_at_the_servers_maxmemory_says_what_to_do() -> None:
    """At maxmemory (noeviction) a get fails, since its lookup writes a read lease; the error was
    the server's own "OOM command not allowed..." under the script's name, which says nothing of
    why a read needs memory or what to do. It now names the memory used and the limit, says the
    call changed nothing, and what frees the index."""
    with LocalCluster(1, host_bytes=16 << 20) as cluster:
        assert cluster.server is not None
        with connect(cluster.redis_url, namespace=cluster.namespace) as client:
            with server_at_maxmemory(client, cluster.redis_url), pytest.raises(MooncakeError) as info:
                client.get("m3")
            message = str(info.value)
            assert re.search(r"used \d+ B of maxmemory \d+ B", message), message
            assert "read lease" in message and "maxmemory" in message and "changed nothing" in message
            assert bytes(client.get("m3")) == b"z" * 100


def test_a_put_right_after_an_index_outage_waits_for_the_nodes_next_heartbeats() -> None:
    """An index out of reach for longer than a TTL (stalled here by SIGSTOP, by its PID) comes back
    with every node past its deadline until each agent's next heartbeat: a put at once failed with
    NoCapacity, "no live agent is registered (start one: `mooncake up`)", advice to start the
    cluster that was running. Registered nodes past their deadlines are a table in flux: the put
    waits for it, within timeout_s."""
    ttl_s = 1.5
    with LocalCluster(1, host_bytes=8 << 20, heartbeat_ttl_s=ttl_s) as cluster:
        assert cluster.server is not None
        with connect(cluster.redis_url, namespace=cluster.namespace, timeout_s=10.0) as client:
            client.put("before", b"A" * 1000)
            stop_process(cluster.server.pid)
            try:
                time.sleep(2 * ttl_s)
            finally:
                os.kill(cluster.server.pid, signal.SIGCONT)
            client.put("after", b"B" * 1000)
            assert bytes(client.get("after")) == b"B" * 1000
            assert bytes(client.get("before")) == b"A" * 1000


def test_a_read_under_a_long_lease_asks_the_index_again_past_what_an_agent_holds(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """An index that lost its data lost the leases it granted, and an agent whose record vanished
    holds its memory only VANISHED_HOLD_MS (a default lease) before reusing it. A same-host read
    under a longer lease (lease_ms=60000) trusted it for 48 s, so a copy slower than the hold read
    whatever the memory held by then, unchecked. Its budget is now at most the hold: a read that
    took longer (here an shm copy held 1.2 x VANISHED_HOLD_MS) asks the index again."""
    cluster = make_cluster(1, host_bytes=8 * MiB)
    client = make_client(cluster, lease_ms=60_000, transports=("shm",))
    client.put("slow", np.full(1000, 7, np.uint8))
    real_read_into = client._shm.read_into
    real_lookup = client.index.lookup
    checks: list[int] = []

    def slow_read_into(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.2 * VANISHED_HOLD_MS / 1000)
        return real_read_into(*args, **kwargs)

    def lookup(keys: Any, **kwargs: Any) -> Any:
        if kwargs.get("lease_ms") == 0:
            checks.append(len(keys))  # the re-check of a read that outlived its budget
        return real_lookup(keys, **kwargs)

    client._shm.read_into = slow_read_into  # type: ignore[method-assign]
    client.index.lookup = lookup  # type: ignore[method-assign]
    assert client.get("slow").tolist() == [7] * 1000
    assert checks == [1], "a read past the agent's hold was not checked against the index"


def test_a_wall_clock_step_on_the_client_host_does_not_move_the_servers_now_it_reckons(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client reckons the index's time (to judge nodes past their heartbeat deadlines from its
    cached node table) as its own clock plus an offset taken with each table read. On the wall
    clock, a step between two reads (NTP, a VM resumed) moved that reckoning by the step: an hour
    ahead, every node looked dead until the next read. It runs on the monotonic clock now."""
    cluster = make_cluster(1, host_bytes=8 * MiB)
    client = make_client(cluster)
    client.stat()  # a table read: the offset is taken
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600.0)
    reckoned, actual = client._server_now_ms(), client.index.server_time_ms()
    assert abs(reckoned - actual) < 2_000, f"off by {(reckoned - actual) / 1000:.1f} s after a 1 h step"


def test_a_same_host_copy_that_spanned_a_suspend_of_the_reading_host_asks_the_index_again(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease runs on the index's clock, which goes on while the reading host is suspended; the
    read's budget ran on the monotonic clock, which stops then, so a copy that spanned a suspend
    longer than the lease looked as quick as it was and its bytes (perhaps of a block freed and
    reused meanwhile) went unchecked. The suspend is simulated: CLOCK_BOOTTIME, which counts it,
    jumps 60 s during the copy while the monotonic clock does not move."""
    cluster = make_cluster(1, host_bytes=8 * MiB)
    client = make_client(cluster, transports=("shm",))
    client.put("slept", np.full(1000, 9, np.uint8))
    real_read_into, real_lookup, real_clock = client._shm.read_into, client.index.lookup, time.clock_gettime
    suspended_s = 0.0
    checks: list[int] = []

    def clock_gettime(clock: int) -> float:
        return real_clock(clock) + (suspended_s if clock == time.CLOCK_BOOTTIME else 0.0)

    def read_into_across_a_suspend(*args: Any, **kwargs: Any) -> Any:
        nonlocal suspended_s
        suspended_s += 60.0
        return real_read_into(*args, **kwargs)

    def lookup(keys: Any, **kwargs: Any) -> Any:
        if kwargs.get("lease_ms") == 0:
            checks.append(len(keys))  # the re-check of a read that outlived its budget
        return real_lookup(keys, **kwargs)

    monkeypatch.setattr(time, "clock_gettime", clock_gettime)
    client._shm.read_into = read_into_across_a_suspend  # type: ignore[method-assign]
    client.index.lookup = lookup  # type: ignore[method-assign]
    assert client.get("slept").tolist() == [9] * 1000
    assert checks == [1], "a copy across a suspend longer than its lease was not checked against the index"


def test_a_put_pinned_to_a_node_right_after_an_index_outage_waits_for_its_heartbeat(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """After an index outage longer than a TTL every node is past its deadline until its next
    heartbeat, and a put waits for them (within timeout_s). One pinned with preferred_node failed at
    once with ConnectError ("past its heartbeat deadline"), meant for one dead node among live
    ones. The outage is written into the index: every deadline long past."""
    cluster = make_cluster(1, host_bytes=8 * MiB)
    client = make_client(cluster, timeout_s=10)
    node_id = cluster.agents[0].node_id
    client.index.redis.zadd(client.index.prefix + "hb", {node_id: 1000})
    client.put("after-outage", np.arange(100, dtype=np.uint8), preferred_node=node_id)
    assert np.array_equal(client.get("after-outage"), np.arange(100, dtype=np.uint8))


def test_a_replicated_put_made_while_some_nodes_are_back_after_an_empty_restart_waits_for_the_rest(
    direct_agent: Callable[..., Any], client_of: Callable[[str], Client], namespace: str
) -> None:
    """After an empty restart the agents register again one by one, at their own heartbeats. A
    replicas=2 put whose fresh table held the first one back failed at once, "replicas=2 needs 2
    live nodes ... only 1 qualify", a second before the other was back (a probe of 2026-12-07, 9 of
    10 tries): only an empty table, or one of nodes all past their deadlines, was taken for the
    index in flux. A node the client saw, gone from the table while its deadline still ran and
    not by a purge (which marks it), is one the index forgot: the put waits for it, within
    timeout_s. Agents here heartbeat only when told; the index forgets by a flush of the namespace."""
    first = direct_agent(namespace, node_id="n0-first")
    second = direct_agent(namespace, node_id="n1-second")
    client = client_of(namespace)
    client.put("before", b"A" * 1000, replicas=2)  # the client has read both in its table
    redis = first.index.redis
    redis.delete(*redis.scan_iter(match=first.index.prefix + "*", count=1000))
    first.heartbeat_once()  # registered again; the second not yet
    assert set(client._node_table(refresh=True)) == {first.node_id}
    back = threading.Timer(0.5, second.heartbeat_once)
    back.start()
    try:
        client.put("after", b"B" * 1000, replicas=2)
    finally:
        back.join()
    meta = client.object_meta("after")
    assert meta is not None and {r.node_id for r in meta.replicas} == {first.node_id, second.node_id}
    assert bytes(client.get("after")) == b"B" * 1000


def test_a_replicated_put_fails_at_once_where_a_node_left(
    direct_agent: Callable[..., Any], client_of: Callable[[str], Client], namespace: str
) -> None:
    """A node that left (its agent stopped: purged, and marked so) is no node in flux: the put is
    refused at once, as before."""
    first = direct_agent(namespace, node_id="n0-first")
    second = direct_agent(namespace, node_id="n1-second")
    client = client_of(namespace)
    client.put("before", b"A" * 1000, replicas=2)
    second.stop()
    assert set(client._node_table(refresh=True)) == {first.node_id}
    with pytest.raises(MooncakeError, match=r"replicas=2 needs 2 live nodes") as refused:
        client.put("after", b"B" * 1000, replicas=2)
    assert "for the nodes to register again" not in str(refused.value)  # refused, not waited out


def test_an_empty_table_read_just_before_the_first_node_registered_again_is_in_flux(
    direct_agent: Callable[..., Any], client_of: Callable[[str], Client], namespace: str
) -> None:
    """After an empty restart, a put read an empty table; the agent then registered (recording a
    heartbeat) before the put asked whether the table was in flux, and an empty table with a
    heartbeat recorded was taken for agents that left: "no live agent is registered", at once,
    with the agent back (CI, once). The node the client saw, gone with its deadline running and
    unmarked by a purge, keeps the table in flux, and the put's next look finds it."""
    agent = direct_agent(namespace, node_id="n0-only")
    client = client_of(namespace)
    client.put("before", b"A" * 1000)
    redis = agent.index.redis
    redis.delete(*redis.scan_iter(match=agent.index.prefix + "*", count=1000))
    assert client._node_table(refresh=True) == {}  # what the put read
    agent.heartbeat_once()  # registered again, in between
    assert client.index.heartbeat_recorded()
    assert client._puts._in_flux()
    client.put("after", b"B" * 1000)
    assert bytes(client.get("after")) == b"B" * 1000
