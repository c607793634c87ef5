"""An agent that stalls past its heartbeat deadline and finds its node id taken over when it wakes
stops, with exit status 1 and a message saying why (it used to drop its memory and log an error on
every heartbeat, forever, serving nothing). Real agent processes and the session's real Valkey."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import node_row, stop_process, wait_until

from mooncake_store import Client, LocalCluster
from mooncake_store.agent import takeover
from mooncake_store.index.client import RedisIndex
from mooncake_store.index.node_table import NodeIdTaken
from mooncake_store.transport.shm import local_host_id
from mooncake_store.types import ALLOC_TAG_SHIFT


def test_a_stalled_agent_whose_node_id_was_taken_over_stops(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(0, heartbeat_ttl_s=1.5)
    old = cluster.add_agent(node_id="x")
    stop_process(old.pid)
    try:
        client = make_client(cluster)
        assert wait_until(lambda: not client.stat().nodes or client.stat().nodes[0].alive is False, 10), client.stat()
        time.sleep(0.5)  # past the deadline: a new incarnation may take the id over
        new = cluster.add_agent(node_id="x")
    finally:
        os.kill(old.pid, signal.SIGCONT)
    code = old.process.wait(timeout=20)
    assert code == 1, code
    log = old.log_tail()
    assert "taken over" in log, log
    assert new.alive()
    client.put("after", np.arange(1024, dtype=np.uint8))
    assert np.array_equal(client.get("after"), np.arange(1024, dtype=np.uint8))
    (node,) = client.stat().nodes
    assert node.node_id == "x" and node.pid == new.pid


def test_a_restarted_agent_never_takes_the_alloc_tag_of_the_incarnation_it_replaces(
    make_inproc_agent: Callable[..., object], monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """Alloc ids start again at (tag << ALLOC_TAG_SHIFT) + 1 in every incarnation, with 16 random
    bits of tag: once in 65536 restarts a successor drew its predecessor's tag and handed out the
    very same ids, so a WRITE of the old incarnation still on the wire could land in a new
    reservation. The successor now draws another tag. (uuid4 is made to give both incarnations
    the same first bits: the draw itself is what is under test.)"""
    from mooncake_store.agent.node import Agent
    from mooncake_store.config import AgentConfig

    # Two incarnations whose first 16 bits (the tag) agree; the rest differs (the segment's name).
    draws = iter(uuid.UUID(f"0001{n:04x}-0000-4000-8000-000000000000") for n in range(1, 100))
    monkeypatch.setattr(uuid, "uuid4", lambda: next(draws))
    namespace = f"t-{os.getpid()}-tag"
    first = make_inproc_agent(namespace=namespace, node_id="tagged")
    assert first.alloc_tag == 1  # type: ignore[attr-defined]
    # Its successor, built while the node table still lists the first incarnation (as after a
    # crash, before the reaper): not started, so that the first one is not taken over.
    second = Agent(
        AgentConfig(node_id="tagged", host_bytes=4 << 20, prefault=False), redis_url=redis_url, namespace=namespace
    )
    try:
        assert second.incarnation[:4] == first.incarnation[:4]  # type: ignore[attr-defined]
        assert second.alloc_tag == 2, f"the successor drew tag {second.alloc_tag}, its predecessor's"
        assert next(second.table.ids) >> ALLOC_TAG_SHIFT == 2
    finally:
        second.arena.close(unlink=True)
        second.index.close()


def test_no_incarnation_of_a_node_id_takes_an_alloc_tag_an_earlier_one_took_within_a_day(
    make_inproc_agent: Callable[..., object], monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """Only the listed record's tag was avoided: once the node stopped (or was reaped) there was
    no record, and a successor drawing its tag handed out the very ids a put of the stopped
    incarnation, still pending (its record lives minutes), could commit into. Nor, after two
    restarts, the tag of the one before last. The three incarnations here draw the same tag."""
    from mooncake_store.agent.node import Agent
    from mooncake_store.config import AgentConfig

    draws = (uuid.UUID(f"0001{n:04x}-0000-4000-8000-000000000000") for n in itertools.count(1))
    monkeypatch.setattr(uuid, "uuid4", lambda: next(draws))
    namespace = f"t-{os.getpid()}-tags"
    first = make_inproc_agent(namespace=namespace, node_id="tagged")
    assert first.alloc_tag == 1  # type: ignore[attr-defined]
    first.stop()  # type: ignore[attr-defined]  # deregistered: no record lists its tag
    second = make_inproc_agent(namespace=namespace, node_id="tagged")
    assert second.alloc_tag == 2, f"the successor of a stopped node drew tag {second.alloc_tag}, its predecessor's"  # type: ignore[attr-defined]
    # A third, built while the second is listed: neither the listed tag (2) nor the one before (1).
    third = Agent(
        AgentConfig(node_id="tagged", host_bytes=4 << 20, prefault=False), redis_url=redis_url, namespace=namespace
    )
    try:
        assert third.alloc_tag == 3, f"the third incarnation drew tag {third.alloc_tag}"
        # Remembered once registered only: a start refused (the node id held, here never started)
        # took one of the day's 65535 tags each, and a supervisor retrying it every second wrapped
        # the pick onto a recent incarnation's.
        _, remembered = third.index.recent_alloc_tags("tagged", within_ms=60_000)
        assert remembered == {1, 2}, remembered
    finally:
        third.arena.close(unlink=True)
        third.index.close()


def test_an_agent_restarted_at_once_after_a_crash_waits_for_the_dead_one_s_deadline(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """A supervisor restarting a crashed agent at once met "node id 'y' is held by a live agent
    (pid N ...)", about a pid that no longer ran, and the start failed; it succeeded only once the
    dead record's deadline had passed. An agent of this host that is gone is waited for."""
    # A TTL that outlasts the restart on a loaded machine (1.5-1.8 s there for add_agent): with
    # 1.5 s the dead record could expire first, and nothing would be waited for or said.
    cluster = make_cluster(0, heartbeat_ttl_s=6.0)
    crashed = cluster.add_agent(node_id="y")
    crashed.kill()
    again = cluster.add_agent(node_id="y")  # failed before: the dead agent's record was live still
    assert again.alive()
    assert f"still held by pid {crashed.pid} of this host, which is gone" in again.log_tail(), again.log_tail()
    client = make_client(cluster)
    client.put("after", np.arange(64, dtype=np.uint8), preferred_node="y")
    assert np.array_equal(client.get("after"), np.arange(64, dtype=np.uint8))


def test_a_gone_holder_whose_deadline_is_past_the_wait_is_named_as_gone(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a heartbeat TTL longer than the wait, the start gave up with "held by a live agent ...
    or stop that agent", about a process that was not there."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    index = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}")
    try:
        dead = dataclasses.replace(node_row("z"), host_id=local_host_id(), pid=gone.pid)
        index.register_node(dead, incarnation="old", ttl_ms=120_000)
        monkeypatch.setattr(takeover, "TAKEOVER_WAIT_S", 0.3)
        with pytest.raises(NodeIdTaken) as info:
            takeover.register_first(
                index, lambda: dataclasses.replace(dead, pid=os.getpid()), incarnation="new", ttl_ms=120_000
            )
        message = str(info.value)
        assert f"pid {gone.pid} of this host, which is gone" in message, message
        assert "live agent" not in message and "stop that agent" not in message, message
        assert "frees at its heartbeat deadline, in 1" in message, message  # ~119 s
    finally:
        index.close()


def _register_holder(index: RedisIndex, pid: int, pid_start: int) -> Any:
    """A node record of this host held by ``pid``, started at ``pid_start`` (clock ticks)."""
    holder = dataclasses.replace(node_row("z"), host_id=local_host_id(), pid=pid, labels={"pid_start": str(pid_start)})
    index.register_node(holder, incarnation="old", ttl_ms=120_000)
    return holder


def _start_again(index: RedisIndex, holder: Any) -> str:
    """The message a start of the same node id in this process gets (TAKEOVER_WAIT_S is short)."""
    with pytest.raises(NodeIdTaken) as info:
        takeover.register_first(
            index, lambda: dataclasses.replace(holder, pid=os.getpid()), incarnation="new", ttl_ms=120_000
        )
    return str(info.value)


@pytest.mark.parametrize("case", ["zombie", "pid reused"])
def test_a_holder_that_is_a_zombie_or_whose_pid_names_another_process_is_gone(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The holder's liveness was os.kill(pid, 0) alone: a killed agent its supervisor had not yet
    reaped (a zombie), or a pid now given to another process (PID 1 of a restarted container is
    the new agent itself), counted as a live agent, and the start was refused at once ("held by a
    live agent ... stop that agent") instead of waiting for the record's deadline."""
    monkeypatch.setattr(takeover, "TAKEOVER_WAIT_S", 0.3)
    index = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}")
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        if case == "zombie":
            started = start_time_of(zombie.pid)
            assert wait_until(lambda: state_of(zombie.pid) == "Z", 10)
            holder = _register_holder(index, zombie.pid, started)
        else:  # this very process, but not the one the record names
            holder = _register_holder(index, os.getpid(), start_time_of(os.getpid()) - 1)
        message = _start_again(index, holder)
        assert "which is gone" in message and "live agent" not in message, message
    finally:
        zombie.wait(timeout=10)
        index.close()


def test_a_holder_whose_pid_and_start_time_match_is_live(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same pid started at the same time is the holder itself, alive (an agent of this
    process): refused at once, not waited for."""
    monkeypatch.setattr(takeover, "TAKEOVER_WAIT_S", 0.3)
    index = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}")
    try:
        holder = _register_holder(index, os.getpid(), start_time_of(os.getpid()))
        message = _start_again(index, holder)
        assert "held by a live agent" in message, message
    finally:
        index.close()


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def start_time_of(pid: int) -> int:
    return int(_stat(pid)[19])


def state_of(pid: int) -> str:
    return _stat(pid)[0]


def test_a_holder_of_another_pid_namespace_is_not_judged_gone(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers that share a hostname and a kernel share a host id, not their pids: a live
    agent of another container, whose pid names no process here, was judged gone, and a start of
    its node id waited TAKEOVER_WAIT_S and then refused it as "held by pid ... which is gone". A
    holder whose record names another PID namespace is refused at once as a live holder."""
    monkeypatch.setattr(takeover, "TAKEOVER_WAIT_S", 0.3)
    index = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}")
    elsewhere = subprocess.Popen([sys.executable, "-c", "pass"])
    elsewhere.wait()  # a pid that names no process in this namespace
    try:
        holder = dataclasses.replace(
            node_row("z"),
            host_id=local_host_id(),
            pid=elsewhere.pid,
            labels={"pid_start": "12345", takeover.PID_NS_LABEL: "pid:[1]"},
        )
        index.register_node(holder, incarnation="old", ttl_ms=120_000)
        assert not takeover.holder_gone({"host_id": local_host_id(), "pid": holder.pid, "labels": holder.labels})
        message = _start_again(index, holder)
        assert "held by a live agent" in message and "which is gone" not in message, message
        # The same record written from this namespace names a process that is gone here.
        same_ns = dataclasses.replace(
            holder, labels={"pid_start": "12345", takeover.PID_NS_LABEL: takeover.pid_namespace()}
        )
        assert takeover.pid_namespace().startswith("pid:[")
        assert takeover.holder_gone({"host_id": local_host_id(), "pid": same_ns.pid, "labels": same_ns.labels})
    finally:
        index.close()


def test_an_agent_records_its_pid_namespace(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(1)
    index = RedisIndex(cluster.redis_url, namespace=cluster.namespace)
    try:
        row = index.nodes()["agent-0"]
        assert row.labels[takeover.PID_NS_LABEL] == takeover.pid_namespace()
    finally:
        index.close()
