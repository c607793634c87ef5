"""Registering a node id that an agent of this host held before it died: the record is free once
its heartbeat deadline passes, and a start waits for that rather than refuse."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mooncake_store.agent.allocations import AllocationTable
from mooncake_store.errors import MooncakeError
from mooncake_store.index import RedisIndex
from mooncake_store.index.client import VANISHED_HOLD_MS
from mooncake_store.index.node_table import NodeIdTaken
from mooncake_store.transport.shm import local_host_id
from mooncake_store.types import NodeInfo
from mooncake_store.watchdog import start_time

log = logging.getLogger("mooncake.agent")

#: How long a start waits for the record of a gone agent of this host to pass its deadline.
TAKEOVER_WAIT_S = 60.0
#: How long the alloc tags of a node id's incarnations are remembered (index key tags:<node>): longer
#: than a commit naming one of an incarnation's allocations can come (a put's pending record lives
#: four of its reservation TTLs, three client timeouts each, and a minute: 3 min at the default
#: timeout_s of 10 s, a day at one of 2 h; a spill's guard far less).
TAG_MEMORY_MS = 86_400_000
#: How far above its own count of heartbeats and syncs an agent registering again (after a reap)
#: starts its record's: the record a snapshot from before the reap holds counts the calls whose
#: replies were lost too, and must count fewer than the new one for a restore of it to be seen.
REGISTER_COUNT_GAP = 1 << 20
#: The node record's label with its agent's process start time (clock ticks since boot, field 22 of
#: /proc/PID/stat): with the pid, it tells the agent apart from a later process given that pid.
PID_START_LABEL = "pid_start"
#: The node record's label with its agent's PID namespace (the link /proc/self/ns/pid): a pid is
#: judged only in the namespace it was given in. Containers sharing a hostname and a kernel (so a
#: host id) each have their own, and a live agent of one looked gone to a start in the other.
PID_NS_LABEL = "pid_ns"


def pid_namespace() -> str:
    """This process's PID namespace ("pid:[4026531836]"), or "" where procfs does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def register_again(
    index: RedisIndex, info: NodeInfo, *, incarnation: str, ttl_ms: int, tables: list[AllocationTable], beats: int = 0
) -> None:
    """Register a node whose record vanished (reaped, or the index lost it) after its objects were
    doomed (AllocationTable.drop_after_reap): each one's memory is held while a lease on it may
    run, as the purge recorded, or VANISHED_HOLD_MS when no purge did, then freed. ``beats``: the
    count of heartbeats and syncs the record goes on from."""
    registered = index.register_node(info, incarnation=incarnation, ttl_ms=ttl_ms, beats=beats)
    if not registered.purged:
        log.warning(
            "the index lost %s's record with no purge: its objects' memory is held %d ms",
            info.node_id,
            VANISHED_HOLD_MS,
        )
    for table in tables:
        table.hold_reaped(registered.held_ms, at_least_ms=0 if registered.purged else VANISHED_HOLD_MS)


def fresh_alloc_tag(index: RedisIndex, node_id: str, incarnation: str) -> int:
    """16 random bits for this incarnation's alloc ids, never those an incarnation of this node id
    took in the last TAG_MEMORY_MS, a day (its record listed or not) nor the listed one's: ids start again
    at the tag's base, so a predecessor with the same tag handed out the very same ids, and a
    commit or a WRITE of its still on the way (a put's pending record lives minutes) could name a
    reservation of this one. Only the listed record's tag was avoided: after a stop or a reap (no
    record), or two restarts, one start in 65536 took an earlier incarnation's."""
    tag = int(incarnation[:4], 16) or 1
    try:
        previous = index.nodes().get(node_id)
        _, used = index.recent_alloc_tags(node_id, within_ms=TAG_MEMORY_MS)
    except MooncakeError:
        return tag  # the index is out of reach: registering will say so
    if previous is not None:
        used.add(previous.alloc_tag)
    for _ in range(0xFFFF):
        if tag not in used:
            break
        tag = tag % 0xFFFF + 1
    return tag


def remember_alloc_tag(index: RedisIndex, node_id: str, tag: int) -> None:
    """Note ``tag`` among those an incarnation of ``node_id`` took, once it registered: only an
    incarnation that registered hands out ids, and starts refused meanwhile (a supervisor retrying a
    duplicate of a live node every second) would fill the day's 65535 tags, after which the pick
    wraps onto a recent incarnation's."""
    try:
        index.note_alloc_tag(node_id, tag, now_ms=index.server_time_ms(), keep_ms=TAG_MEMORY_MS)
    except MooncakeError:
        pass  # out of reach: the tag is only not remembered (one start in 65536 may take it)


class StartCancelled(MooncakeError):
    """The agent was told to stop (SIGTERM, SIGINT, SIGHUP) while its start waited: a stop asked
    for, not a failure."""


def register_first(
    index: RedisIndex,
    node_info: Callable[[], NodeInfo],
    *,
    incarnation: str,
    ttl_ms: int,
    stop: threading.Event | None = None,
) -> None:
    """Register a starting agent's node id. One still held by an agent of this host whose process
    is gone (killed without its stop: a crash, then a supervisor's restart at once) is free once
    its record's heartbeat deadline passes: wait for it, up to TAKEOVER_WAIT_S, rather than refuse
    the start with a message about a live agent that is not there; one whose deadline is further
    off than that is refused at once. A live holder is refused at once (NodeIdTaken). ``stop`` ends
    the wait (StartCancelled): a sleep held SIGTERM off for the whole wait, and `docker stop` then
    killed the agent."""
    give_up = time.monotonic() + TAKEOVER_WAIT_S
    stop = stop or threading.Event()
    while True:
        info = node_info()
        try:
            index.register_node(info, incarnation=incarnation, ttl_ms=ttl_ms)
            return
        except NodeIdTaken as exc:
            if not holder_gone(exc.holder):
                raise
            if time.monotonic() + exc.left_ms / 1000 > give_up:
                # Not "held by a live agent ... stop that agent": there is none to stop.
                raise NodeIdTaken(
                    f"node id {info.node_id!r} was held by pid {exc.holder.get('pid')} of this host, which is "
                    f"gone; its record frees at its heartbeat deadline, in {exc.left_ms / 1000:.1f} s (a start "
                    f"waits up to {TAKEOVER_WAIT_S:.0f} s for that): start again then, or pick another node id",
                    holder=exc.holder,
                    left_ms=exc.left_ms,
                ) from None
            wait_s = min(exc.left_ms / 1000 + 0.05, max(0.0, give_up - time.monotonic()))
            log.warning(
                "node id %s is still held by pid %s of this host, which is gone; waiting %.1f s for its deadline",
                info.node_id,
                exc.holder.get("pid"),
                wait_s,
            )
            if stop.wait(wait_s):
                raise StartCancelled(f"stopped while waiting for node id {info.node_id!r} to be free") from None


def holder_gone(holder: dict[str, Any]) -> bool:
    """Whether the agent of a node record is a process of this host that no longer runs: its pid
    names no process, a zombie (killed, not yet reaped by its supervisor), or a process started at
    another time than the one the record names (``pid_start``: the pid was reused, as PID 1 is by
    a restarted container, whose new agent would otherwise find itself "held by a live agent"). A
    holder of another PID namespace (``pid_ns``) is not gone: its pid means nothing here."""
    pid = holder.get("pid")
    if holder.get("host_id") != local_host_id() or not isinstance(pid, int) or pid <= 0:
        return False
    labels = holder.get("labels") or {}
    recorded_ns = str(labels.get(PID_NS_LABEL, "")) if isinstance(labels, dict) else ""
    if recorded_ns and recorded_ns != pid_namespace():
        return False  # its pid names a process of another namespace (container): not ours to judge
    started = start_time(pid)
    if started is None:
        # No such process, a zombie, one /proc hides from this user (hidepid), or no procfs.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False  # there, and not ours to see or signal
        return os.path.exists("/proc/self/stat")  # signalled, yet no start time: a zombie
    recorded = str(labels.get(PID_START_LABEL, "")) if isinstance(labels, dict) else ""
    return recorded.isdigit() and int(recorded) != started


def reconcile_after_rollback(
    index: RedisIndex, node_id: str, tables: list[AllocationTable], disk_ids: set[int]
) -> tuple[int, int, list[int]]:
    """After the index went back in time (restored from a snapshot older than this agent's last
    heartbeat), while it holds the node unreadable (node_heartbeat.lua): each replica it lists
    here whose allocation this agent no longer holds is dropped from it (its memory was freed and
    may hold another object now: a same-host read would copy those bytes), as a damaged replica is
    (readers go to the object's other replicas, and one short of its copies is copied again);
    each pending put it lists here that names an allocation this agent does not hold as a
    reservation is revoked (the restore brought it back after the agent revoked it and gave its
    memory to another put, or after it committed: a late or replayed commit would land on that
    memory), and so is each spill guard naming this node whose reservations it no longer holds
    (a peer's late or replayed swap would land); each committed allocation it no longer names is
    doomed, held a default read lease, then freed (nothing would ever free it), and no
    reservation is freed within such a lease either. What both still agree on stays. Returns
    (replicas dropped, pending puts and guards revoked, disk allocations to free now: disk files
    have no same-host readers)."""
    named = index.node_replicas(node_id)
    # Not a doomed allocation: its memory is about to go, whatever the index says of it.
    held = set(disk_ids).union(*(set(table.committed_ids()) | set(table.reserved_deadlines()) for table in tables))
    dropped = 0
    for alloc_id, key in named.items():
        if alloc_id not in held:
            dropped += int(index.drop_corrupt(key, alloc_id, node_id=node_id))
    pending, guards = index.pending_on_node(node_id)
    # Read after the walk: a put reserved during it (RESERVE is served meanwhile) is among these.
    # One freed meanwhile was freed by its writer, who revoked its record first (a sync, which
    # revokes and frees too, is held off by the caller's lock).
    reserved: dict[int, bytes] = {}
    for table in tables:
        reserved.update(table.live_reservations())
    guarded = {put_id.hex() for put_id in reserved.values()}
    stale = [put_id for put_id, allocs in pending.items() if not allocs <= reserved.keys()]
    revoked = index.put_revoke(stale + sorted(guards - guarded))
    for table in tables:
        table.doom([a for a in table.committed_ids() if a not in named], hold_ms=VANISHED_HOLD_MS)
        # An object committed after the snapshot whose ack this agent had not drained is a
        # reservation here, freed once it expires; readers may still copy it under the old leases.
        table.hold_reservations(VANISHED_HOLD_MS)
    return dropped, revoked, sorted(a for a in disk_ids if a not in named)
