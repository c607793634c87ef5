"""The index server out of reach for longer than the agents' reap grace (stalled here, SIGSTOP by
its PID; a server out of memory refuses heartbeats alike): its clock ran on, every node missed
its deadline at once, and the first agent whose heartbeat landed afterwards reaped its healthy
peers with all their objects (50 of 100 lost with two agents). Losing contact with the index is
no node's death: after such a gap each node gets its grace again."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from helpers import server_at_maxmemory, stop_process, wait_until

from mooncake_store import LocalCluster, MooncakeError, connect
from mooncake_store.embedded import EmbeddedServer
from mooncake_store.transport.shm import ShmTransport


def test_agents_that_outlive_an_index_stall_keep_their_objects() -> None:
    ttl_s = 1.5
    with LocalCluster(2, host_bytes=16 << 20, heartbeat_ttl_s=ttl_s) as cluster:
        assert cluster.server is not None
        with connect(cluster.redis_url, namespace=cluster.namespace, timeout_s=5.0) as client:
            values = {f"k{i}": np.full(1000, i, np.int32) for i in range(40)}
            for i, (key, value) in enumerate(values.items()):
                client.put(key, value, preferred_node=f"agent-{i % 2}")
            stop_process(cluster.server.pid)
            try:
                time.sleep(3 * 2 * ttl_s)  # past every node's deadline and reap time
            finally:
                os.kill(cluster.server.pid, signal.SIGCONT)
            time.sleep(4 * ttl_s)  # heartbeats land again, and any reaper has had its turns
            assert sorted(client.index.nodes()) == ["agent-0", "agent-1"]
            got = client.get_many(list(values))
            lost = [k for k, v in zip(values, got, strict=True) if v is None or not np.array_equal(v, values[k])]
            assert lost == [], f"{len(lost)} of {len(values)} objects lost after the index stalled"
            assert all(agent.alive() for agent in cluster.agents)


@pytest.mark.parametrize("taken_in", [True, False], ids=["committed-here", "still-reserved-here"])
def test_a_reader_under_its_lease_never_gets_other_bytes_after_the_index_restarts_empty(
    monkeypatch: pytest.MonkeyPatch, taken_in: bool
) -> None:
    """The index server dies and comes back empty while a same-host reader copies an object under
    its read lease (the copy is slowed to 2.5 s, inside the lease's budget, by a wrapper around the
    reader thread's shm copy). The agent found its record gone, freed every object's memory at once
    (no purge had recorded the leases: the index lost them), a new put took the block, and the
    reader returned the new object's bytes under the old key. Memory is now held for a client's
    default read lease first; the read returns the old bytes, or fails, never another's.
    ``taken_in`` False: the agent had not yet drained the commit's ack (its syncs are a minute
    apart here), so it still held the object as a reservation, which it expired and freed at its
    next sync: the lost index had committed it and the reader leased it, so it is held too. The
    objects take 5 of the 8 MiB, so that the new put needs the old one's block."""
    size = 5 << 20
    if not taken_in:
        monkeypatch.setenv("MOONCAKE_AGENT_SYNC_INTERVAL_S", "60")  # the agents inherit it
    real_read_into = ShmTransport.read_into
    copying = threading.Event()  # the reader has looked up, leased, and is in its copy

    def slow_for_the_reader(self: ShmTransport, *args: object, **kwargs: object) -> None:
        if threading.current_thread().name == "slow-reader":
            copying.set()
            time.sleep(2.5)
        real_read_into(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ShmTransport, "read_into", slow_for_the_reader)
    first = EmbeddedServer().start()
    again: EmbeddedServer | None = None
    try:
        with LocalCluster(1, host_bytes=8 << 20, redis_url=first.url, namespace="restart-empty") as cluster:
            reader = connect(first.url, namespace=cluster.namespace, transports=("shm",))
            writer = connect(first.url, namespace=cluster.namespace)
            try:
                writer.put("K", b"A" * size)
                # The agent learns of the commit at its next syncs (the ack, then the confirmation
                # of its reply): until then its table holds K as a reservation. Each case made sure
                # of (the ack list empty, or not), not left to the timing.
                (node,) = writer.index.nodes()
                acks = [f"{writer.index.prefix}{kind}:{node}" for kind in ("acks", "acksout")]
                raw = first.client()
                if taken_in:
                    assert wait_until(lambda: raw.exists(*acks) == 0, 10), "the agent never took in the commit"
                else:
                    assert raw.exists(*acks) > 0, "the agent took in the commit: the case is not reached"
                raw.close()
                outcome: list[object] = []

                def read() -> None:
                    try:
                        outcome.append(bytes(reader.get("K")))
                    except MooncakeError as exc:
                        outcome.append(exc)

                thread = threading.Thread(target=read, name="slow-reader")
                thread.start()
                # Not a sleep: on a loaded machine the reader may not have looked up yet, and the
                # outage then fails its lookup, which the test accepts without any copy under way.
                assert copying.wait(30), f"the reader never reached its copy: {outcome}"
                os.kill(first.pid, signal.SIGKILL)
                first.stop()
                again = EmbeddedServer(port=first.port).start()  # the same address, empty
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        writer.put("OTHER", b"B" * size)
                        break
                    except MooncakeError:
                        time.sleep(0.05)  # until the agent has registered again
                thread.join(30)
                assert len(outcome) == 1
                got = outcome[0]
                assert not isinstance(got, bytes) or got == b"A" * size, (
                    f"the reader got other bytes: {got[:8]!r}... ({got.count(b'B')} B of 'B')"
                )
            finally:
                reader.close()
                writer.close()
    finally:
        if again is not None:
            again.stop()
        first.stop()


def test_removing_absent_keys_from_a_full_server_says_they_were_absent() -> None:
    """At maxmemory (noeviction), a remove of keys that are not there failed with the server's
    OOM error: the script's record of its answer (for a retry) was its first write, which a full
    server refuses. The answer stands without its record."""
    with LocalCluster(1, host_bytes=16 << 20) as cluster:
        assert cluster.server is not None
        with (
            connect(cluster.redis_url, namespace=cluster.namespace) as client,
            server_at_maxmemory(client, cluster.redis_url),
        ):
            assert client.remove_many(["absent-1", "absent-2"]) == [False, False]
            assert client.remove_many(["absent-3", "m7"]) == [False, True]
