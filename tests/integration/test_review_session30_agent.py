"""Agents, from a walk through the README's "Running agents yourself" (session 30):
`python -m mooncake_store.agent` installed its signal handlers only after its arena was made and
prefaulted, so a SIGTERM or SIGHUP in those seconds killed it by the default action and left the
whole arena in /dev/shm; a start waiting for a dead holder's node id slept through SIGTERM for up
to a minute, and waited that minute even where the record's deadline lay further off, then
failed; and its exit codes were 1 where `mooncake agent` says 4 (no Redis) or 5 (no room). Seen
on the way: a closed client left its pooled sockets to the garbage collector."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from helpers import node_row, refused_agent, wait_until

from mooncake_store import LocalCluster
from mooncake_store.agent import takeover
from mooncake_store.index.client import RedisIndex
from mooncake_store.index.node_table import NodeIdTaken
from mooncake_store.tiers.host import segment_paths, segment_pattern
from mooncake_store.transport.shm import local_host_id


@pytest.fixture
def index(redis_url: str) -> Iterator[RedisIndex]:
    index = RedisIndex(redis_url, namespace=f"t-{uuid.uuid4().hex[:10]}")
    yield index
    index.close()


def _gone_holder(index: RedisIndex, ttl_ms: int) -> object:
    """A record of node "z" held by a process of this host that has exited."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = dataclasses.replace(node_row("z"), host_id=local_host_id(), pid=gone.pid)
    index.register_node(dead, incarnation="old", ttl_ms=ttl_ms)
    return dead


def test_a_stop_ends_the_wait_for_a_dead_holders_deadline(index: RedisIndex) -> None:
    dead = _gone_holder(index, ttl_ms=30_000)  # frees in ~30 s, within the 60 s a start waits
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    with pytest.raises(takeover.StartCancelled, match="stopped while waiting for node id 'z'"):
        takeover.register_first(
            index, lambda: dataclasses.replace(dead, pid=os.getpid()), incarnation="new", ttl_ms=30_000, stop=stop
        )
    assert time.monotonic() - started < 5.0  # it slept up to 30 s


def test_a_deadline_past_the_wait_is_refused_at_once(index: RedisIndex) -> None:
    dead = _gone_holder(index, ttl_ms=120_000)
    started = time.monotonic()
    with pytest.raises(NodeIdTaken, match=r"which is gone; its record frees at its heartbeat deadline, in 1\d\d"):
        takeover.register_first(
            index, lambda: dataclasses.replace(dead, pid=os.getpid()), incarnation="new", ttl_ms=120_000
        )
    assert time.monotonic() - started < 5.0  # it waited 60 s, then failed all the same


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_while_the_arena_is_made_stops_the_agent_and_removes_it(redis_url: str, sig: int) -> None:
    namespace, node_id = f"t-{uuid.uuid4().hex[:10]}", f"s{sig}"
    cmd = [
        sys.executable, "-m", "mooncake_store.agent", "--redis-url", redis_url, "--namespace", namespace,
        "--node-id", node_id, "--host-bytes", "2GiB",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pattern = segment_pattern(namespace, node_id, proc.pid)
    try:
        # The segment is there as soon as it is made; its 2 GiB are prefaulted after that.
        assert wait_until(lambda: bool(segment_paths(pattern)) or proc.poll() is not None, 60, 0.005)
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for path in segment_paths(pattern):  # what the agent left, removed by its exact name
            path.unlink(missing_ok=True)
    assert proc.returncode == 0, err
    assert "READY" not in out and "Traceback" not in err, err
    assert not segment_paths(pattern)


def test_the_agent_module_exits_with_the_clis_codes() -> None:
    status, err = refused_agent("--redis-url", "redis://127.0.0.1:1/0", "--host-bytes", "4MiB", "--no-prefault")
    assert status == 4, err  # cannot connect, as `mooncake agent` says
    assert "error: " in err and "Traceback" not in err, err


def test_a_closed_client_closes_its_pooled_connections_itself(make_cluster: Callable[..., LocalCluster]) -> None:
    """close() let go of the pool before listing its connections, which the list held only
    weakly: they were left to the garbage collector (ResourceWarning: unclosed socket)."""
    cluster = make_cluster(1)
    script = (
        "import gc, sys\n"
        "from mooncake_store import connect\n"
        "client = connect(sys.argv[1], namespace=sys.argv[2], transports=('tcp',))\n"
        "client.put('k', b'x' * 1000)\n"
        "assert client.get('k').tobytes() == b'x' * 1000\n"
        "client.close()\n"
        "gc.collect()\n"
    )
    result = subprocess.run(
        [sys.executable, "-X", "dev", "-c", script, cluster.redis_url, cluster.namespace],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "ResourceWarning" not in result.stderr, result.stderr


def test_an_advertised_address_that_is_the_redis_servers_is_refused(redis_url: str) -> None:
    """The Redis server never answers the agent's frame (it waits for the end of a line), so the
    self-check found "no answer" and only warned: every put for the node then went to Redis."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
    redis_endpoint = redis_url.removeprefix("redis://").split("/")[0]
    status, err = refused_agent(
        "--redis-url", redis_url, "--namespace", f"t-{uuid.uuid4().hex[:10]}", "--host-bytes", "4MiB",
        "--no-prefault", "--listen", f"127.0.0.1:{port}", "--advertise", redis_endpoint,
    )  # fmt: skip
    assert status == 2, err
    assert f"agent.advertise={redis_endpoint!r} answers, but as a Redis server" in err, err


def test_the_agent_module_takes_host_mem_as_the_cli_does(redis_url: str) -> None:
    """`mooncake agent` and docker-compose say --host-mem, this module only --host-bytes."""
    status, err = refused_agent("--redis-url", redis_url, "--host-mem", "100", "--no-prefault")
    assert status == 2 and "100" in err and "unrecognized arguments" not in err, err  # the size refused, not the flag
