"""A pressure pass that planned victims into two tiers of one peer (its host tier up to its mark,
then its disk tier: the cross-tier fallback) sent the second batch to that peer after the first
had timed out on it (review, thirty-sixth session): a hung peer cost the pass its timeout once per
tier, and writers waiting for room waited with it. README: "A peer that timed out mid-batch
(hung) costs that one timeout". The peer is now skipped for the rest of the pass, as the
docstring of the pass said, and what was planned for it placed again.

An in-process agent A with no disk tier; peer B a real agent process with a small host tier and a
disk tier, stopped (SIGSTOP, by its PID) as the first spill to it starts."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from helpers import stop_process, wait_until

from mooncake_store import LocalCluster, connect
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20


def _idle(agent: Agent) -> None:
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


def test_a_hung_peer_is_asked_once_per_pass_not_once_per_tier(
    make_inproc_agent: Callable[..., Agent], redis_url: str, tmp_path: Path
) -> None:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    settings: dict[str, Any] = {"namespace": namespace, "spill_to_peers": True, "prepare": _idle}
    a = make_inproc_agent(host_bytes=8 * MiB, high_watermark=0.5, low_watermark=0.25, **settings)  # no disk
    cluster = LocalCluster(
        1,
        redis_url=redis_url,
        namespace=namespace,
        host_bytes=2 * MiB,  # takes 7 of the 256 KiB victims under its 90 % mark; the rest go to its disk
        heartbeat_ttl_s=30.0,
        agent_args=["--no-prefault", "--no-spill", "--disk", str(tmp_path), "--disk-mem", str(16 * MiB)],
    )
    cluster.start()
    b = cluster.agents[0]
    stopped = False
    client = connect(a.index.url, namespace=namespace)
    try:
        rng = np.random.default_rng(36)
        values = {f"h{i:02d}": rng.integers(0, 256, 256 * KiB, dtype=np.uint8) for i in range(20)}
        for key, value in values.items():  # 5 MiB on A's 8 MiB, past its 4 MiB mark
            client.put(key, value, preferred_node=a.node_id)
        a.sync_once()
        assert wait_until(lambda: b.node_id in a.index.nodes(), 10.0)
        spiller = a.pressure._spiller
        real_spill = spiller.spill
        asked: list[tuple[str, TierKind, int]] = []

        def stop_b_then_spill(peer_node: Any, jobs: Any, **kwargs: Any) -> Any:
            nonlocal stopped
            asked.append((peer_node.node_id, kwargs["tier"], len(jobs)))
            if peer_node.node_id == b.node_id and not stopped:
                stop_process(b.process.pid)  # hung, while the table still lists it alive
                stopped = True
            return real_spill(peer_node, jobs, **kwargs)

        spiller.spill = stop_b_then_spill  # type: ignore[method-assign]
        a.pressure.relieve_host()
        spiller.spill = real_spill  # type: ignore[method-assign]
        to_b = [(tier, n) for node, tier, n in asked if node == b.node_id]
        assert len(to_b) == 1, f"the pass asked the hung {b.node_id} {len(to_b)} times: {asked}"
        os.kill(b.process.pid, signal.SIGCONT)
        stopped = False
        for key, value in values.items():  # nothing lost: each stayed on A or was evicted, never torn
            meta = client.object_meta(key)
            if meta is not None:
                assert np.array_equal(client.get(key), value), key
    finally:
        if stopped:
            os.kill(b.process.pid, signal.SIGCONT)
        client.close()
        cluster.stop()
