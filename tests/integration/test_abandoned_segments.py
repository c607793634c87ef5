"""An agent killed without its stop (SIGKILL, the OOM killer) leaves its arena in /dev/shm, and a
restarted agent of the same node creates its own under a new name: each crash leaked an arena's
memory until /dev/shm filled and agents could not start. An agent now holds a lock on its arena
for as long as it maps it, and removes, once it has registered its node id, the arenas of earlier
agents of that id that no process holds."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import wait_until

from mooncake_store import LocalCluster
from mooncake_store.agent.node import Agent
from mooncake_store.index.client import RedisIndex
from mooncake_store.tiers.host import SHM_DIR, HostArena, segment_name

MiB = 1 << 20


def dead_pid() -> int:
    """The pid of a process that has exited (its agent died)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    return int(proc.stdout)


@pytest.fixture
def made() -> Iterator[list[Path]]:
    paths: list[Path] = []
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_an_agent_removes_the_arenas_earlier_agents_of_its_node_left(
    make_inproc_agent: Callable[..., Agent], made: list[Path]
) -> None:
    namespace, node_id = f"t-{uuid.uuid4().hex[:10]}", f"sw-{uuid.uuid4().hex[:6]}"
    left = SHM_DIR / segment_name(namespace, node_id, pid=dead_pid(), incarnation="0123456789ab")
    left.write_bytes(b"\x00" * 4096)  # a crashed agent's: no process holds it
    lookalike = SHM_DIR / segment_name(namespace, node_id + ".1", pid=dead_pid(), incarnation="0123456789ab")
    lookalike.write_bytes(b"\x00" * 4096)  # another node's, whose name starts like this one's
    made.extend([left, lookalike])
    held = HostArena.create(segment_name(namespace, node_id, incarnation="feedfeedfeed"), MiB, prefault=False)
    try:  # an arena this process maps: a live agent of the node (stalled, say) keeps its own
        agent = make_inproc_agent(namespace=namespace, node_id=node_id)
        assert not left.exists(), "the dead agent's arena was left in /dev/shm"
        assert lookalike.exists() and held.path.exists()
        assert (SHM_DIR / agent.arena.name).exists()
    finally:
        held.close()


def test_a_node_restarted_after_each_crash_holds_one_arena(make_cluster: Callable[..., LocalCluster]) -> None:
    """Real agent processes killed with SIGKILL and started again under the same node id (once
    the dead one's deadline has passed), their segments left in place as a crash leaves them
    (LocalCluster removes them only at its stop)."""
    cluster = make_cluster(0, heartbeat_ttl_s=1.5)
    prefix = segment_name(cluster.namespace, "crashy", pid=0)[:-2]  # up to the pid

    def arenas() -> set[str]:
        return {p.name for p in SHM_DIR.glob(prefix + ".*")}

    index = RedisIndex(cluster.redis_url, namespace=cluster.namespace, timeout_s=10.0)
    try:
        for _ in range(3):
            cluster.add_agent(node_id="crashy").kill()
            assert wait_until(lambda: index.nodes()["crashy"].heartbeat_deadline_ms < index.server_time_ms(), 10)
        assert len(arenas()) >= 1
        cluster.add_agent(node_id="crashy")
        assert len(arenas()) == 1, sorted(arenas())
    finally:
        index.close()
