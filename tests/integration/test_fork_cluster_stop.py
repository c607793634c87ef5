"""LocalCluster.stop() in a forked child (its copy's ``with`` block ending): in the child
Popen.poll() meets ECHILD and reads every running agent as exited, so stop() went straight to
removing the parent's agents' shared-memory arenas and disk tiers, their processes left running.
As EmbeddedServer.stop, it now does nothing outside the process that started the cluster."""

from __future__ import annotations

import os

from helpers import in_forked_child

from mooncake_store import LocalCluster, connect
from mooncake_store.tiers.host import SHM_DIR


def test_a_forked_childs_stop_leaves_the_parents_agents_and_arenas(redis_url: str) -> None:
    with LocalCluster(1, redis_url=redis_url, namespace=f"t-forkstop-{os.getpid()}", host_bytes=8 << 20) as cluster:
        agent = cluster.agents[0]
        arena = SHM_DIR / agent.shm_name

        def stop_all() -> str:
            agent.kill()
            agent.terminate()
            agent.stop()
            cluster.stop()  # what the child's `with` exit does
            return "stopped"

        assert arena.exists() and agent.alive()
        assert in_forked_child(stop_all) == "stopped"
        assert agent.alive() and arena.exists(), "the child's stop() reached the parent's agent"
        with connect(cluster.redis_url, namespace=cluster.namespace) as client:
            node = next(iter(client.index.nodes().values()))
            assert client._shm.reachable(node.shm_name)
            client.put("k", b"v" * 64)
            assert bytes(client.get("k")) == b"v" * 64
    assert not arena.exists()  # the parent's own stop still removes it
