"""Memory reuse under same-host readers after an index rollback or a replayed swap (review,
thirty-first session; the first two were left open then as strict xfails, and are fixed since:
the beat that finds the index gone back ends the node's deadline instead of extending it, and the
reconcile revokes restored pending puts naming memory the agent no longer reserves).

Each runs an in-process agent whose loops are idle, its heartbeats, syncs and moves called by the
test, and restores the index from a DUMP taken earlier as a server restarted from its last save
would."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis
from helpers import guarded_spill_copy

from mooncake_store import Client, MooncakeError
from mooncake_store.agent.node import Agent
from mooncake_store.index.client import NodeSuperseded
from mooncake_store.index.node_table import IndexWentBack, NodeIdTaken

MiB = 1 << 20


def snapshot_of(raw: redis.Redis, prefix: str) -> dict[bytes, bytes]:
    return {k: raw.dump(k) for k in raw.scan_iter(match=prefix + "*", count=1000)}  # type: ignore[misc]


def restore(raw: redis.Redis, prefix: str, snapshot: dict[bytes, bytes], **extra_zadd: dict[str, int]) -> None:
    """The namespace's keys replaced by ``snapshot`` in one transaction, as a restart would."""
    pipe = raw.pipeline(transaction=True)
    for key in raw.scan_iter(match=prefix + "*", count=1000):
        pipe.delete(key)
    for key, dumped in snapshot.items():
        pipe.restore(key, 0, dumped, replace=True)
    for name, members in extra_zadd.items():
        pipe.zadd(prefix + name, members)
    pipe.execute()


def idle_loops(agent: Agent) -> None:
    """No heartbeat nor pressure pass but the test's own."""
    agent._heartbeat_loop = lambda: None  # type: ignore[method-assign]
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


def test_a_put_commit_revived_by_a_rollback_does_not_land_on_a_reused_block(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    agent = make_inproc_agent(
        host_bytes=4 * MiB, reserve_timeout_s=0.2, heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0
    )
    agent.heartbeat_once()
    writer, other, reader = clients(agent), clients(agent), clients(agent)
    raw = agent.index.redis
    prefix = agent.index.prefix
    mine, theirs = np.full(MiB, 0xAA, np.uint8), np.full(MiB, 0xBB, np.uint8)
    real_commit = writer.index.put_commit
    seen: dict[str, object] = {}

    def late_commit(ids: list[str], **kwargs: object) -> list[str]:
        if seen:
            return real_commit(ids, **kwargs)  # type: ignore[arg-type]
        agent.heartbeat_once()
        snapshot = snapshot_of(raw, prefix)  # the pending record is in it
        time.sleep(0.3)  # the writer stalls past reserve_timeout_s after its bytes landed
        agent.sync_once()  # revoked ("R"), the block freed
        other.put("B", theirs)  # ... and taken
        agent.sync_once()
        agent.heartbeat_once()
        restore(raw, prefix, snapshot)  # the index goes back: the pending record with it
        agent.heartbeat_once()  # the count went back: reconcile_after_rollback
        seen["statuses"] = statuses = real_commit(ids, **kwargs)  # type: ignore[arg-type]
        return statuses

    writer.index.put_commit = late_commit  # type: ignore[method-assign]
    try:
        writer.put("A", mine)
    except Exception as exc:  # a refused commit is the right outcome: the put says so
        seen.setdefault("error", exc)
    agent.sync_once()
    assert "statuses" in seen, f"the late commit was never tried: {seen.get('error')!r}"
    assert seen["statuses"] == ["EXPIRED"], "the late commit landed on a block the agent had given to another put"
    assert not reader.exists("A") or np.array_equal(reader.get("A"), mine)


def test_a_commit_during_the_reconcile_after_a_rollback_is_refused(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """The restored pending record names a block given to another put since; a commit that comes
    while the agent reconciles (before it revokes the record) must not land either."""
    agent = make_inproc_agent(
        host_bytes=4 * MiB, reserve_timeout_s=0.2, heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0
    )
    agent.heartbeat_once()
    writer, other = clients(agent), clients(agent)
    raw, prefix = agent.index.redis, agent.index.prefix
    real_commit = writer.index.put_commit
    real_node_replicas = agent.index.node_replicas
    seen: dict[str, object] = {}

    def commit_in_the_reconcile(node_id: str) -> dict[int, str]:
        seen["statuses"] = real_commit(seen.pop("ids"))  # type: ignore[arg-type]
        return real_node_replicas(node_id)

    def late_commit(ids: list[str], **kwargs: object) -> list[str]:
        agent.heartbeat_once()
        snapshot = snapshot_of(raw, prefix)
        time.sleep(0.3)  # past the reservation: revoked and freed by the sync, then taken
        agent.sync_once()
        other.put("B", np.full(MiB, 0xBB, np.uint8))
        agent.sync_once()
        agent.heartbeat_once()
        restore(raw, prefix, snapshot)
        seen["ids"] = ids
        agent.index.node_replicas = commit_in_the_reconcile  # type: ignore[method-assign]
        agent.heartbeat_once()
        return ["EXPIRED"] * len(ids)

    writer.index.put_commit = late_commit  # type: ignore[method-assign]
    with pytest.raises(MooncakeError):
        writer.put("A", np.full(MiB, 0xAA, np.uint8))
    assert "ids" not in seen, "the reconcile never ran"
    assert seen["statuses"] == ["GONE"], "a commit during the reconcile landed on a block given to another put"


def test_a_put_whose_reservation_is_still_held_commits_after_a_rollback(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """The reconcile revokes only the restored pending puts naming memory the agent no longer
    reserves: a put in flight across the rollback, its reservation live, still commits."""
    agent = make_inproc_agent(
        host_bytes=4 * MiB, reserve_timeout_s=30.0, heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0
    )
    agent.heartbeat_once()
    writer, other, reader = clients(agent), clients(agent), clients(agent)
    raw, prefix = agent.index.redis, agent.index.prefix
    mine = np.full(MiB, 0xAA, np.uint8)
    real_commit = writer.index.put_commit
    real_pending = agent.index.pending_on_node
    seen: dict[str, object] = {}

    def noted_pending(node_id: str) -> tuple[dict[str, set[int]], set[str]]:
        seen["pending"], guards = real_pending(node_id)
        return seen["pending"], guards  # type: ignore[return-value]

    def commit_after_the_rollback(ids: list[str], **kwargs: object) -> list[str]:
        agent.heartbeat_once()
        snapshot = snapshot_of(raw, prefix)
        other.put("B", np.full(MiB, 0xBB, np.uint8))  # committed after the snapshot
        agent.sync_once()
        agent.heartbeat_once()
        restore(raw, prefix, snapshot)
        agent.index.pending_on_node = noted_pending  # type: ignore[method-assign]
        agent.heartbeat_once()  # the reconcile
        seen["statuses"] = statuses = real_commit(ids, **kwargs)  # type: ignore[arg-type]
        return statuses

    writer.index.put_commit = commit_after_the_rollback  # type: ignore[method-assign]
    writer.put("A", mine)
    assert seen["statuses"] == ["OK"]
    assert len(seen["pending"]) == 1, "the reconcile did not see the put in flight"  # type: ignore[arg-type]
    agent.sync_once()
    assert np.array_equal(reader.get("A"), mine)
    assert not reader.exists("B")  # the index lost it with the rollback; its memory is doomed here


def test_a_put_reserved_during_the_reconcile_is_not_revoked(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """RESERVE is served while the agent reconciles; a put reserved and started during the walk of
    the pending records is no stale one (the reservations are read after the walk)."""
    agent = make_inproc_agent(
        host_bytes=8 * MiB, reserve_timeout_s=30.0, heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0
    )
    agent.heartbeat_once()
    writer, reader = clients(agent), clients(agent)
    writer.put("warm", np.full(1024, 1, np.uint8))  # the writer's node table is read now
    raw, prefix = agent.index.redis, agent.index.prefix
    snapshot = snapshot_of(raw, prefix)
    agent.heartbeat_once()
    restore(raw, prefix, snapshot)
    real_commit, real_pending = writer.index.put_commit, agent.index.pending_on_node
    started, go = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def held_commit(ids: list[str], **kwargs: object) -> list[str]:
        started.set()
        assert go.wait(20)
        statuses = real_commit(ids, **kwargs)  # type: ignore[arg-type]
        seen.setdefault("statuses", statuses)  # the first: a put retries a refused commit
        return statuses

    def put() -> None:
        try:
            writer.put("C", np.full(MiB, 0xCC, np.uint8), preferred_node=agent.node_id)
        except Exception as exc:
            seen["error"] = exc

    writer_thread = threading.Thread(target=put)

    def pending_once_the_put_started(node_id: str) -> tuple[dict[str, set[int]], set[str]]:
        writer_thread.start()  # reserved and put_start done before the walk
        assert started.wait(20)
        return real_pending(node_id)

    writer.index.put_commit = held_commit  # type: ignore[method-assign]
    agent.index.pending_on_node = pending_once_the_put_started  # type: ignore[method-assign]
    agent.heartbeat_once()  # behind: the reconcile, then readable again
    go.set()
    writer_thread.join(30)
    assert seen.get("statuses") == ["OK"], f"the put reserved during the reconcile was revoked: {seen}"
    assert bool((reader.get("C") == 0xCC).all())


def test_a_beat_behind_the_agents_count_ends_the_deadline_until_a_beat_at_the_index_count(
    make_inproc_agent: Callable[..., Agent],
) -> None:
    agent = make_inproc_agent(heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0)
    index, node = agent.index, agent.node_id
    beat = dict(incarnation=agent.incarnation, ttl_ms=60_000, tiers=agent.tiers())
    counted = index.heartbeat(node, **beat, last_beats=0)  # type: ignore[arg-type]
    assert counted is not None and counted >= 1
    with pytest.raises(IndexWentBack) as went:
        index.heartbeat(node, **beat, last_beats=counted + 5)  # type: ignore[arg-type]
    assert went.value.count == counted  # not counted
    now_ms = index.server_time_ms()
    assert index.nodes()[node].heartbeat_deadline_ms < now_ms, "the node stayed readable"
    reap_at = index.redis.zscore(index.prefix + "reap", node)
    assert reap_at is not None and reap_at > now_ms + 60_000, "the node could be reaped while it reconciles"
    # Unreadable, yet its node id is not free: a second agent started with it is refused.
    with pytest.raises(NodeIdTaken):
        index.register_node(agent.node_info(), incarnation="another", ttl_ms=60_000)
    assert index.heartbeat(node, **beat, last_beats=counted) == counted + 1  # type: ignore[arg-type]
    assert index.nodes()[node].heartbeat_deadline_ms > now_ms + 30_000
    assert "reconciling_until" not in index.redis.hget(index.prefix + "nodes", node)  # type: ignore[operator]


def test_a_sync_counts_and_one_behind_the_agents_count_drains_nothing(
    make_inproc_agent: Callable[..., Agent],
) -> None:
    """Syncs count as heartbeats do (a snapshot taken between the last beat and a sync whose
    revokes and graves the agent freed must be told apart); one that finds the count behind the
    agent's drains nothing: its acks and graves belong to an index it must first reconcile with."""
    agent = make_inproc_agent(heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0)
    index, node = agent.index, agent.node_id
    sync = dict(incarnation=agent.incarnation, expired_put_ids=[], applied_last=True)
    counted = index.heartbeat(node, incarnation=agent.incarnation, ttl_ms=60_000, tiers=agent.tiers())
    assert counted is not None
    assert index.agent_sync(node, **sync, last_count=counted).count == counted + 1  # type: ignore[arg-type]
    index.redis.rpush(index.prefix + "acks:" + node, "12345")
    with pytest.raises(IndexWentBack) as went:
        index.agent_sync(node, **sync, last_count=counted + 5)  # type: ignore[arg-type]
    assert went.value.count == counted + 1
    assert index.redis.lrange(index.prefix + "acks:" + node, 0, -1) == ["12345"], "a sync behind drained acks"
    assert index.agent_sync(node, **sync, last_count=counted + 1).acked_alloc_ids == [12345]  # type: ignore[arg-type]


def test_a_rollback_to_between_a_beat_and_a_sync_is_reconciled_at_the_next_sync(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """No heartbeat between the snapshot and the restore (a failover to a replica a moment behind,
    with beats a second apart): the sync that freed K's old block after the snapshot is counted,
    so the next sync finds the index behind and the node is reconciled before K is read again."""

    agent = make_inproc_agent(host_bytes=8 * MiB, heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0, prepare=idle_loops)
    client = clients(agent, lease_ms=100)
    raw, prefix = agent.index.redis, agent.index.prefix
    client.put("K", np.full(5 * MiB, 0xAA, np.uint8), preferred_node=agent.node_id)
    agent.sync_once()
    agent.heartbeat_once()
    snapshot = snapshot_of(raw, prefix)  # no beat after this one
    client.put("K", np.full(MiB, 0x11, np.uint8), preferred_node=agent.node_id)  # K's old block buried...
    time.sleep(0.2)  # ... past its read lease
    agent.sync_once()
    agent.sync_once()  # ... freed
    client.put("Y", np.full(5 * MiB, 0xBB, np.uint8), preferred_node=agent.node_id)  # ... and taken
    agent.sync_once()
    restore(raw, prefix, snapshot)
    agent.sync_once()  # finds the count behind: drains nothing, wakes the heartbeat loop...
    assert agent._beat_now.is_set(), "the sync did not find the index behind"
    agent.heartbeat_once()  # ... whose beat reconciles (this test's loop is idle)
    got = client.get("K") if client.exists("K") else None
    assert got is None or bool((got == 0xAA).all()), "K read as another object's bytes"


def test_a_rollback_to_before_a_reap_is_told_apart_after_registering_again(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """Reaped while it stalled, the agent registers again under its incarnation; the record's count
    went back to 0 with it, so an index restored to a snapshot from before the reap (the old record,
    a higher count) looked current, and K's old block, reused since, was read as K."""

    agent = make_inproc_agent(host_bytes=8 * MiB, heartbeat_interval_s=1.0, heartbeat_ttl_s=5.0, prepare=idle_loops)
    client = clients(agent)
    raw, prefix = agent.index.redis, agent.index.prefix
    client.put("K", np.full(5 * MiB, 0xAA, np.uint8), preferred_node=agent.node_id)
    agent.sync_once()
    for _ in range(5):
        agent.heartbeat_once()
    snapshot = snapshot_of(raw, prefix)
    raw.zadd(prefix + "hb", {agent.node_id: 1})  # stalled past its deadline...
    raw.zadd(prefix + "reap", {agent.node_id: 2})
    assert clients(agent).index.reap_dead_nodes(grace_ms=0) == [agent.node_id]  # ... and reaped
    agent.heartbeat_once()  # its record gone: it registers again
    agent.sync_once()
    client.put("Y", np.full(5 * MiB, 0xBB, np.uint8), preferred_node=agent.node_id)  # K's block, likely
    agent.sync_once()
    agent.heartbeat_once()
    restore(raw, prefix, snapshot)
    agent.heartbeat_once()
    got = client.get("K") if client.exists("K") else None
    assert got is None or bool((got == 0xAA).all()), "K read as another object's bytes"


def test_a_second_restore_to_a_newer_snapshot_of_the_old_timeline_is_told_apart(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """Backup A is restored, then the newer backup B: had the reconcile after A set the agent's
    count down to A's, B's (higher) would have looked current, and K's block, reused since, been
    read as K. The count never goes back."""
    agent = make_inproc_agent(host_bytes=8 * MiB, heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0, prepare=idle_loops)
    client = clients(agent, lease_ms=100)
    raw, prefix = agent.index.redis, agent.index.prefix
    agent.heartbeat_once()
    snapshot_a = snapshot_of(raw, prefix)
    client.put("K", np.full(5 * MiB, 0xAA, np.uint8), preferred_node=agent.node_id)
    for _ in range(5):
        agent.sync_once()
        agent.heartbeat_once()
    snapshot_b = snapshot_of(raw, prefix)
    client.put("K", np.full(MiB, 0x11, np.uint8), preferred_node=agent.node_id)  # the old block buried...
    time.sleep(0.2)
    agent.sync_once()
    agent.sync_once()  # ... freed
    client.put("Y", np.full(5 * MiB, 0xBB, np.uint8), preferred_node=agent.node_id)  # ... and taken
    agent.sync_once()
    agent.heartbeat_once()
    restore(raw, prefix, snapshot_a)
    agent.heartbeat_once()  # behind: reconciled
    restore(raw, prefix, snapshot_b)
    agent.heartbeat_once()
    got = client.get("K") if client.exists("K") else None
    assert got is None or bool((got == 0xAA).all()), "K read as another object's bytes"


def test_a_rollback_to_before_a_reap_right_after_registering_again_is_told_apart(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """The restore lands before the agent's first call after registering again: had the record
    started from the agent's own count, the old record (as high) would have looked current."""
    agent = make_inproc_agent(host_bytes=8 * MiB, heartbeat_interval_s=1.0, heartbeat_ttl_s=5.0, prepare=idle_loops)
    client = clients(agent, lease_ms=100)
    raw, prefix = agent.index.redis, agent.index.prefix
    client.put("K", np.full(5 * MiB, 0xAA, np.uint8), preferred_node=agent.node_id)
    agent.sync_once()
    for _ in range(5):
        agent.heartbeat_once()
    snapshot = snapshot_of(raw, prefix)  # at the agent's count
    raw.zadd(prefix + "hb", {agent.node_id: 1})
    raw.zadd(prefix + "reap", {agent.node_id: 2})
    assert clients(agent).index.reap_dead_nodes(grace_ms=0) == [agent.node_id]
    agent.heartbeat_once()  # registers again
    time.sleep(0.2)  # K's read lease over
    restore(raw, prefix, snapshot)  # before the agent's next call
    agent.sync_once()
    assert agent._beat_now.is_set(), "the sync did not find the index behind"
    client.put("Y", np.full(5 * MiB, 0xBB, np.uint8), preferred_node=agent.node_id)
    agent.sync_once()
    agent.heartbeat_once()
    got = client.get("K") if client.exists("K") else None
    assert got is None or bool((got == 0xAA).all()), "K read as another object's bytes"


def test_syncs_while_registering_again_over_a_purge_give_no_false_rollback(
    make_inproc_agent: Callable[..., Agent],
) -> None:
    """Reaped while it stalled, the agent registers again while the purge is under way (steps of
    5000 keys); its syncs meanwhile counted on the record being purged, and the agent took the
    index for gone back once the new record started from a lower count: a reconcile, the node
    unreadable, for no rollback. A sync answers SUPERSEDED while its node is being purged."""
    agent = make_inproc_agent(heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0, prepare=idle_loops)
    for _ in range(3):
        agent.heartbeat_once()
    raw, prefix, node = agent.index.redis, agent.index.prefix, agent.node_id
    pipe = raw.pipeline(transaction=False)
    for i in range(0, 30_000, 1000):
        pipe.sadd(prefix + "nobj:" + node, *[f"gone/{j}" for j in range(i, i + 1000)])
    pipe.sadd(prefix + "purging", node)  # a reaper's purge under way
    pipe.execute()
    real_run, real_reconcile = agent.index._run, agent._reconcile
    reconciled: list[object] = []

    def register_steps_with_syncs_between(name: str, *args: object, **kwargs: object) -> object:
        if name == "node_register":
            with contextlib.suppress(NodeSuperseded):  # the answer while the purge runs
                agent.sync_once()  # the sync loop runs on between the purge's steps
        return real_run(name, *args, **kwargs)

    def noted(went_back: IndexWentBack) -> bool:
        reconciled.append(went_back)
        return real_reconcile(went_back)

    agent.index._run = register_steps_with_syncs_between  # type: ignore[method-assign]
    agent._reconcile = noted  # type: ignore[method-assign]
    agent.heartbeat_once()  # the record is being purged: registers again, in steps
    agent.index._run = real_run  # type: ignore[method-assign]
    agent.sync_once()
    agent.heartbeat_once()
    assert not reconciled and not agent._beat_now.is_set(), f"a false rollback: {reconciled}"


def test_a_spill_guard_revived_by_a_rollback_lets_no_late_swap_land(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """A spills "obj" to B (guard, reservation, bytes) and stalls before its swap; B's reservation
    times out, its sync deletes the guard and frees the block, which another put takes. The index
    then goes back to a snapshot holding the guard: A's late swap must not name that block."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    a = make_inproc_agent(namespace=namespace, heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0)
    b = make_inproc_agent(namespace=namespace, reserve_timeout_s=0.2, heartbeat_interval_s=30.0, heartbeat_ttl_s=60.0)
    client = clients(a)
    raw, prefix = a.index.redis, a.index.prefix
    peer = SimpleNamespace(node_id=b.node_id, endpoint=b.server.endpoint)
    old, new, guard = guarded_spill_copy(client, a, peer, size=MiB)
    for agent in (a, b):
        agent.heartbeat_once()
    snapshot = snapshot_of(raw, prefix)  # the guard is in it
    time.sleep(0.3)
    b.sync_once()  # the reservation timed out: the guard deleted, the block freed...
    assert raw.get(prefix + "pend:" + guard) is None
    client.put("other", np.full(MiB, 0xBB, np.uint8), preferred_node=b.node_id)  # ... and taken
    b.sync_once()
    for agent in (a, b):
        agent.heartbeat_once()
    restore(raw, prefix, snapshot)
    assert raw.get(prefix + "pend:" + guard) is not None
    for agent in (a, b):
        agent.heartbeat_once()  # each finds the index behind and reconciles
    (status,) = client.index.move_replicas([("obj", old.alloc_id, new, guard)], old_node=a.node_id)
    assert status == "EXPIRED", "the late swap named a block the peer had given to another put"
    assert bool((client.get("obj") == 0xAA).all())


def test_stale_replicas_are_not_readable_while_a_rollback_is_reconciled(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:

    agent = make_inproc_agent(host_bytes=8 * MiB, heartbeat_interval_s=1.0, heartbeat_ttl_s=5.0, prepare=idle_loops)
    client = clients(agent)
    raw = agent.index.redis
    prefix = agent.index.prefix
    client.put("K", np.full(5 * MiB, 0xAA, np.uint8), preferred_node=agent.node_id)
    agent.sync_once()
    agent.heartbeat_once()
    snapshot = snapshot_of(raw, prefix)
    client.put("K", np.full(MiB, 0x11, np.uint8), preferred_node=agent.node_id)  # K's old block freed...
    agent.sync_once()
    agent.sync_once()
    client.put("Y", np.full(5 * MiB, 0xBB, np.uint8), preferred_node=agent.node_id)  # ... and taken
    agent.heartbeat_once()  # a beat after the snapshot's: the restore is told apart
    restore(raw, prefix, snapshot, hb={agent.node_id: 1})  # the snapshot's deadline long past
    assert not client.exists("K")  # before the beat nothing on the node is readable
    real_drop = agent.index.drop_corrupt
    in_reconcile, read = threading.Event(), threading.Event()

    def slow_drop(*args: object, **kwargs: object) -> object:
        # The reconcile's first drop waits for the read: a reconcile of many stale replicas takes
        # one round trip each, and a read in the middle of it is what is tested.
        in_reconcile.set()
        read.wait(10)
        return real_drop(*args, **kwargs)  # type: ignore[arg-type]

    agent.index.drop_corrupt = slow_drop  # type: ignore[method-assign]
    beat = threading.Thread(target=agent.heartbeat_once)
    beat.start()
    try:
        assert in_reconcile.wait(10)
        got: object = client.get("K")
    except Exception as exc:  # not readable during the reconcile: the right outcome
        got = exc
    finally:
        read.set()
        beat.join(10)
    assert not isinstance(got, np.ndarray) or bool((got == 0xAA).all()), "K read as another object's bytes"


def test_a_replayed_promotion_swap_keeps_a_leased_target(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """move_replica is replayed after a lost reply; when the first run landed and the object was
    removed after a reader leased the new host block, the replay answered GONE and the promotion
    freed that block at once (table.free), not through the graveyard at the lease's end. A refused
    local swap now asks the index whether its target landed before it drops it."""
    agent = make_inproc_agent(host_bytes=8 * MiB, disk_path=str(tmp_path), disk_bytes=16 * MiB)
    client = clients(agent)
    client.put("obj", np.full(MiB, 0xAA, np.uint8), preferred_node=agent.node_id)
    (victim,) = agent.index.victim_candidates(agent.node_id, "host")
    location = agent.table.offset_of(victim.alloc_id)
    assert location is not None and agent.pressure.moves.demote_to_disk(victim, location[0])
    agent.sync_once()
    (disk_id,) = list(agent.disk_keys)
    data = agent.read_disk(disk_id)
    assert data is not None
    real_move = agent.index.move_replica
    seen: dict[str, object] = {}

    def replayed(*args: object, **kwargs: object) -> object:
        first = real_move(*args, **kwargs)  # lands; its reply is lost with the connection
        (meta,) = client.index.lookup(["obj"], lease_ms=5000).objects  # a same-host reader leases it
        assert meta is not None
        seen["leased"] = meta.replicas[0]
        client.remove("obj")  # the new block goes to the graveyard until that lease ends
        seen["statuses"] = (first, second := real_move(*args, **kwargs))  # the retry runs it again
        return second

    agent.index.move_replica = replayed  # type: ignore[method-assign]
    agent.pressure.moves.promote(disk_id, data)
    leased = seen["leased"]
    assert agent.table.offset_of(leased.alloc_id) is not None, (  # type: ignore[attr-defined]
        f"the leased host block was freed at once (statuses {seen['statuses']})"
    )
