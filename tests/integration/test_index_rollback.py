"""An index restored from a snapshot older than the agents' last heartbeats (a Redis restarted
from its last RDB save, say) names memory the agents have freed and used again since: a same-host
read copied another object's bytes under the old key, and the memory the restored index no longer
named stayed allocated for good. Agents now see the index's count of their heartbeats go back,
take their nodes' replicas out of it and start afresh."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import beat_since, wait_until

from mooncake_store import KeyNotFound, LocalCluster, connect
from mooncake_store.agent.allocations import AllocationTable
from mooncake_store.agent.node import Agent
from mooncake_store.agent.takeover import reconcile_after_rollback
from mooncake_store.embedded import EmbeddedServer
from mooncake_store.index.client import VANISHED_HOLD_MS, RedisIndex

KiB = 1 << 10


def test_an_index_restored_from_an_older_snapshot_never_serves_other_bytes() -> None:
    server = EmbeddedServer().start()
    try:
        namespace = "rollback"
        prefix = f"mc:{{{namespace}}}:".encode()
        with (
            LocalCluster(1, redis_url=server.url, namespace=namespace, host_bytes=16 << 20),
            connect(server.url, namespace=namespace, lease_ms=300) as client,
        ):
            raw = server.client()
            values = {f"a{i}": np.full(256 * KiB, i, np.uint8) for i in range(10)}
            client.put_many(values)
            kept = {f"c{i}": np.full(128 * KiB, 50 + i, np.uint8) for i in range(4)}  # untouched since
            client.put_many(kept)
            time.sleep(1.5)  # a heartbeat lands after the puts: the snapshot has it
            snapshot = {k: raw.dump(k) for k in raw.scan_iter(match=prefix + b"*", count=1000)}
            client.remove_many([f"a{i}" for i in range(5)])
            client.put_many({f"a{i}": np.full(256 * KiB, 100 + i, np.uint8) for i in range(5, 10)})
            time.sleep(1.0)  # the leases run out, the graves are freed...
            client.put_many({f"b{i}": np.full(256 * KiB, 200 + i, np.uint8) for i in range(10)})  # ...and used again
            time.sleep(2.5)  # heartbeats after the snapshot's
            # In one transaction, as a restart would: no heartbeat may see the keys half gone.
            restore = raw.pipeline(transaction=True)
            for key in raw.scan_iter(match=prefix + b"*", count=1000):
                restore.delete(key)
            for key, dumped in snapshot.items():
                restore.restore(key, 0, dumped, replace=True)
            restore.execute()
            restored_at = time.monotonic()
            # The agent's next heartbeat finds the count gone back and drops the replicas of
            # memory it no longer holds: every a (removed or replaced since the snapshot). Until
            # that beat the node may also look past its deadline (the snapshot's), and nothing on
            # it readable: the c's too (a full run once read them in between).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (
                any(client.exists(k) for k in values) or not beat_since(client, restored_at)
            ):
                time.sleep(0.1)
            for key in values:
                with pytest.raises(KeyNotFound):
                    client.get(key)
            for key, value in kept.items():  # what the snapshot and the agent agree on stays
                assert np.array_equal(client.get(key), value), key
            # The node is registered again and serves new objects; its old memory comes back.
            fresh = np.arange(64 * KiB, dtype=np.uint8)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.put("fresh", fresh)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert np.array_equal(client.get("fresh"), fresh)
            client.remove("fresh")
            # The b's memory, committed after the snapshot, is named nowhere: freed after a
            # default read lease. What stays allocated is the c's.
            want = sum(v.nbytes for v in kept.values())
            deadline = time.monotonic() + 15
            used = None
            while time.monotonic() < deadline:
                (node,) = client.stat().nodes
                used = sum(t.used_bytes for t in node.tiers)
                if used == want:
                    break
                time.sleep(0.3)
            assert used == want, f"{used} B allocated for {want} B of objects the restored index names"
    finally:
        server.stop()


def test_a_promotion_under_way_when_the_index_went_back_keeps_its_target(
    make_inproc_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """The reconcile after a rollback dooms the committed allocations the index does not name. A
    promotion (a disk object copied into a committed host block, then swapped in the index) under
    way as it read the index had its block doomed; the swap landed after, and the index named a
    block freed a default lease later. The reconcile now waits for local moves under way, and they
    for it; and a swap let go meanwhile is refused, since the beat that found the index behind
    holds the node unreadable until the reconcile is done."""
    agent = make_inproc_agent(host_bytes=8 << 20, disk_path=str(tmp_path), disk_bytes=16 << 20)
    client = connect(agent.index.url, namespace=agent.namespace)
    value = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
    try:
        client.put("obj", value)
        (victim,) = agent.index.victim_candidates(agent.node_id, "host")
        location = agent.table.offset_of(victim.alloc_id)
        assert location is not None and agent.pressure.moves.demote_to_disk(victim, location[0])
        real_move = agent.index.move_replica
        swapping, release = threading.Event(), threading.Event()

        def held_promotion(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("promotion"):
                swapping.set()
                assert release.wait(30)
            return real_move(*args, **kwargs)

        agent.index.move_replica = held_promotion  # type: ignore[method-assign]
        real_node_replicas = agent.index.node_replicas
        read_index = threading.Event()  # the reconcile read the index (before the swap, if now)

        def noted_read(*args: Any, **kwargs: Any) -> Any:
            read_index.set()
            return real_node_replicas(*args, **kwargs)

        agent.index.node_replicas = noted_read  # type: ignore[method-assign]
        assert np.array_equal(client.get("obj"), value)  # read from disk; the promotion follows
        assert swapping.wait(10), "no promotion after the disk read"
        agent._beats = 1 << 40  # the index answers fewer heartbeats than this: it went back
        reconcile = threading.Thread(target=agent.heartbeat_once)
        reconcile.start()
        # Not a sleep: the reconcile must have got as far as it goes before the swap is let go,
        # waiting at the moves' gate (as it does now) or reading the index (as it did); a loaded
        # machine could otherwise release the swap first, and nothing raced.
        gate = agent.pressure.moves.gate
        assert wait_until(lambda: gate._reconciling or read_index.is_set(), 10), "the reconcile never ran"
        release.set()
        reconcile.join(timeout=30)
        assert not reconcile.is_alive()

        # The swap lands, or (let go while the beat that found the index behind holds the node
        # unreadable) is refused and its target dropped: either way every replica the index names
        # is memory the agent holds, once the doomed blocks' hold is over.
        time.sleep(VANISHED_HOLD_MS / 1000 + 0.5)
        agent.sync_once()
        meta = client.object_meta("obj")
        assert meta is not None
        for replica in meta.replicas:
            held = replica.alloc_id in agent.disk_keys or agent.table.offset_of(replica.alloc_id) is not None
            assert held, f"the index names {replica}, a block the agent freed"
        assert np.array_equal(client.get("obj"), value)
    finally:
        client.close()


def test_after_a_rollback_no_reservation_is_freed_within_a_read_lease(redis_url: str) -> None:
    """An object committed after the snapshot, whose ack the agent had not drained, is only a
    reservation here; the restored index lost the ack with the object, so the agent's sync expires
    and frees it, while a same-host reader that leased it before the restore may still copy it.
    Its block must not go to another object within a read lease (it went at the first sync past
    its deadline: a reserve timeout shorter than the lease put another object under the copy)."""
    index = RedisIndex(redis_url, namespace=f"rollback-{uuid.uuid4().hex[:8]}")
    try:
        table = AllocationTable(1 << 20, reserve_timeout_s=0.05, alignment=64)
        (late,) = (x.alloc_id for x in table.reserve([(4096, b"p" * 16)]))  # type: ignore[union-attr]
        reconcile_after_rollback(index, "n1", [table], set())
        time.sleep(0.1)  # past its reserve timeout: the next sync revokes and frees it
        assert table.free([late]) == 1
        assert late in table and table.reserve([(1 << 20, b"q" * 16)]) is None, "its block went within a lease"
        assert table.release_held() == 0
    finally:
        index.close()
