"""The Agent: wires the host arena, the allocation table, the TCP server and the index together,
and runs the background duties (heartbeat, sync, reaping dead peers)."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mooncake_store.agent.allocations import AllocationTable
from mooncake_store.agent.failure_log import FailureLog
from mooncake_store.agent.inbox import DiskInbox
from mooncake_store.agent.other_tiers import OtherTierHooks
from mooncake_store.agent.pressure import PressureManager
from mooncake_store.agent.self_check import check_advertised
from mooncake_store.agent.server import AgentServer
from mooncake_store.agent.syncing import SyncDuties
from mooncake_store.agent.takeover import (
    PID_NS_LABEL,
    PID_START_LABEL,
    REGISTER_COUNT_GAP,
    fresh_alloc_tag,
    pid_namespace,
    reconcile_after_rollback,
    register_again,
    register_first,
    remember_alloc_tag,
)
from mooncake_store.agent.usage import tier_usages
from mooncake_store.config import AgentConfig
from mooncake_store.errors import ConnectError, MooncakeError, NoCapacity
from mooncake_store.index import RedisIndex
from mooncake_store.index.client import VANISHED_HOLD_MS
from mooncake_store.index.node_table import IndexWentBack, NodeIdTaken
from mooncake_store.tiers.disk import DiskTier
from mooncake_store.tiers.disk_dir import sweep_abandoned_tiers
from mooncake_store.tiers.gpu import GpuArena
from mooncake_store.tiers.host import INCARNATION_CHARS, HostArena, segment_name, sweep_abandoned_segments
from mooncake_store.transport.fence import GPU_FENCE_LABEL
from mooncake_store.transport.shm import local_host_id
from mooncake_store.types import ALLOC_TAG_SHIFT, NodeInfo, TierKind, TierUsage, TransportKind
from mooncake_store.watchdog import start_time

log = logging.getLogger("mooncake.agent")


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Agent(OtherTierHooks, SyncDuties):
    def __init__(self, config: AgentConfig, *, redis_url: str, namespace: str) -> None:
        config.check_published_endpoint()
        self.config = config
        self.node_id = config.node_id or default_node_id()
        self.namespace = namespace
        self.incarnation = uuid.uuid4().hex
        self.index_timeout_s = max(2.0, config.heartbeat_ttl_s)
        self.index = RedisIndex(redis_url, namespace=namespace, timeout_s=self.index_timeout_s)
        try:
            self.arena = self._create_arena(config)
        except BaseException:
            self.index.close()
            raise
        try:
            # Every alloc id of this incarnation carries its tag (types.ALLOC_TAG_SHIFT), published
            # in the node table: clients holding a copy of the table from before a restart notice.
            self.alloc_tag = fresh_alloc_tag(self.index, self.node_id, self.incarnation)
            # By the index's clock, as every time the node table holds: `stat` shows the uptime from it.
            self.started_ms = self.index.server_time_ms()
            self.table = AllocationTable(
                config.host_bytes,
                reserve_timeout_s=config.reserve_timeout_s,
                ids=itertools.count((self.alloc_tag << ALLOC_TAG_SHIFT) + 1),
            )
            # Each agent gets a directory of its own under disk_path: the disk tier clears what it
            # finds there at start (files of an earlier incarnation that the index no longer lists).
            # expanduser: a "~/kv" from a TOML file or env (no shell to expand it) means the home directory.
            self.disk = self._disk_tier(config) if config.disk_bytes else None
            self.disk_keys: dict[int, str] = {}  # disk alloc id -> key, for promotion
            # Chunk files whose replica was dropped for failing their checksum, until freed: no
            # victim of a pass (a spill's refusal names one; sent again, the peer refused the pass
            # the rest of its victims), and dropped and counted once.
            self.damaged_disk_ids: set[int] = set()
            # Chunk files that peers spill onto this disk tier, until their swaps are acked.
            self.inbox = (
                DiskInbox(self.disk, reserve_timeout_s=config.reserve_timeout_s, ids=self.table.ids)
                if self.disk is not None
                else None
            )
            self.gpu: GpuArena | None = None
            self.gpu_table: AllocationTable | None = None
            if config.gpu_bytes:
                self.gpu = GpuArena(config.gpu_id, config.gpu_bytes)
                self.gpu_table = AllocationTable(
                    config.gpu_bytes, reserve_timeout_s=config.reserve_timeout_s, ids=self.table.ids
                )
                # Demotions copy GPU blocks into the host arena: pinned, they run at DMA speed.
                self.arena.pin_for_devices(config.gpu_id)
            self.pressure = PressureManager(self)
            self.server = AgentServer(config.listen, self.arena, self.table, timeout_s=30.0, hooks=self)
        except BaseException:
            # A half-built agent must not leave its segment, its device memory (and IPC handle) or
            # its disk directory behind. The directory goes as a stopped agent's does: the tier
            # cleared an earlier incarnation's chunk files as it started, and holds none of its own
            # yet (released and kept, it stayed with its lock file in it).
            if getattr(self, "gpu", None) is not None:
                self.gpu.close()
            if getattr(self, "disk", None) is not None:
                self.disk.close()
            self.arena.close(unlink=True)
            self.index.close()
            raise
        self._stop = threading.Event()
        #: Why this agent can no longer serve (its node id was taken over), once it cannot.
        self.fatal: str | None = None
        self._init_sync_state()
        #: One heartbeat at a time (tests and the loop).
        self._beat_lock = threading.Lock()
        #: A registration after a vanished record went unanswered: its hold of what was doomed is owed.
        self._hold_owed = False
        self._threads: list[threading.Thread] = []

    # ---- tiers ------------------------------------------------------------------------------
    def _create_arena(self, config: AgentConfig) -> HostArena:
        """The host arena, under a name with the incarnation as well as the pid: an agent restarted
        with the same pid (PID 1 in its container) must not publish its predecessor's name, or
        clients that mapped the old segment would go on reading (and writing) it as if it were the
        new one. With no room in /dev/shm, the arenas crashed incarnations of this node id left
        (no process holds their lock) go first, and it is made again: else an arena over half of
        /dev/shm could never be made after a crash (and only a started agent sweeps, in start()).
        Only then: until its record's deadline, same-host clients may still read a dead one."""
        name = segment_name(self.namespace, self.node_id, incarnation=self.incarnation[:INCARNATION_CHARS])
        try:
            return HostArena.create(name, config.host_bytes, prefault=config.prefault)
        except NoCapacity:
            swept = sweep_abandoned_segments(self.namespace, self.node_id, keep="")
            if not swept:
                raise
        for gone in swept:
            log.warning("removed the shared-memory arena %s, left by an earlier agent of node %s", gone, self.node_id)
        return HostArena.create(name, config.host_bytes, prefault=config.prefault)

    def _disk_tier(self, config: AgentConfig) -> DiskTier:
        parent = Path(os.path.expanduser(config.disk_path))
        root = parent / self.node_id
        # Directories of agents that died without stopping (their lock is free) go first: with the
        # default node id every incarnation has a directory of its own, and nothing else removes them.
        if parent.is_dir():
            for gone in sweep_abandoned_tiers(parent, keep=root):
                log.info("removed the disk tier directory %s of an agent that is gone", gone)
        # A peer's chunk file may declare no more raw bytes than this agent's largest memory
        # tier holds: it could never be promoted here, and verifying it takes that much memory.
        # Peers plan by the same rule from the published tiers (NodeInfo.largest_chunk_bytes):
        # change both or neither.
        return DiskTier(root, config.disk_bytes, max_blob_raw_bytes=max(config.host_bytes, config.gpu_bytes))

    def tier_kinds(self) -> tuple[TierKind, ...]:
        kinds = [TierKind.GPU] if self.gpu is not None else []
        kinds.append(TierKind.HOST)
        if self.disk is not None:
            kinds.append(TierKind.DISK)
        return tuple(kinds)

    @staticmethod
    def itemsize_of(dtype: str) -> int:
        try:
            return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        except TypeError:
            return 1

    def tiers(self) -> tuple[TierUsage, ...]:
        return tier_usages(self.table, self.gpu_table, self.disk, self.pressure.counters)

    # ---- hooks of the server (AgentHooks; the other tiers' in agent/other_tiers.py) -----------
    def host_read(self) -> None:
        self.pressure.count(TierKind.HOST, "reads")

    def reserved(self) -> None:
        used, _, _, _ = self.table.usage()
        if used > self.config.high_watermark * self.table.capacity_bytes:
            self.pressure.wake()  # move objects alongside the writer, not in bursts after refusals

    def no_room(self, blocks: list[int], *, spared_peers: int = 0) -> None:
        self.pressure.want_room(blocks, spared_peers=spared_peers)

    def fragmented(self, blocks: list[int]) -> None:
        self.pressure.want_blocks(blocks)

    def expire_other_tiers(self, alloc_ids: list[int]) -> int:
        expired = 0
        for table in self._tables()[1:]:
            expired += table.expire_now(alloc_ids)
        return expired

    def free_allocations(self, alloc_ids: list[int] | tuple[int, ...]) -> None:
        """Free ids of any tier: disk files by id, the rest in the host table."""
        host_ids, gpu_ids = [], []
        for alloc_id in alloc_ids:
            if self.inbox is not None and alloc_id in self.inbox:
                self.inbox.free([alloc_id])
                self.disk_keys.pop(alloc_id, None)  # a spilled file settled here (its ack drained)
                self.damaged_disk_ids.discard(alloc_id)
            elif self.disk is not None and alloc_id in self.disk:
                self.disk.remove(alloc_id)
                self.disk_keys.pop(alloc_id, None)
                self.damaged_disk_ids.discard(alloc_id)
            elif self.gpu_table is not None and alloc_id in self.gpu_table:
                gpu_ids.append(alloc_id)
            else:
                host_ids.append(alloc_id)
        if host_ids:
            self.table.free(host_ids)
        if gpu_ids and self.gpu_table is not None:
            self.gpu_table.free(gpu_ids)

    # ---- node record --------------------------------------------------------------------------
    def node_info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            host=socket.gethostname(),
            host_id=local_host_id(),
            zone=self.config.zone,
            pid=os.getpid(),
            tcp_endpoint=self.config.advertise or self.server.endpoint,
            shm_name=self.arena.name,
            transports=(TransportKind.SHM, TransportKind.TCP),
            tiers=self.tiers(),
            started_ms=self.started_ms,
            alloc_tag=self.alloc_tag,
            # Same-host clients open the GPU arena through this CUDA IPC handle.
            labels={
                # Peers judge whether they may spill here against this agent's own watermark.
                "high_watermark": str(self.config.high_watermark),
                # Peers copy a copy this node may have dropped back only into room under it.
                "low_watermark": str(self.config.low_watermark),
                # A prefaulted arena's pages all exist: a same-host peer may map it populated.
                "prefault": "1" if self.config.prefault else "0",
                # A restart tells this process from a later one given its pid (holder_gone).
                PID_START_LABEL: str(start_time(os.getpid()) or 0),
                PID_NS_LABEL: pid_namespace(),
                # The PCI bus id names the device whatever CUDA_VISIBLE_DEVICES a client runs with.
                **(
                    {
                        "gpu_id": str(self.gpu.device_id),
                        "gpu_ipc": self.gpu.ipc_handle.hex(),
                        "gpu_pci": self.gpu.pci_bus_id,
                        "host_pinned": "1" if self.arena.pinned else "0",
                        # FENCE covers GPU reservations too: a same-host writer's IPC copy waits
                        # for it (an agent without this label is written unfenced, as before).
                        GPU_FENCE_LABEL: "1",
                    }
                    if self.gpu
                    else {}
                ),
            },
        )

    @property
    def _ttl_ms(self) -> int:
        return int(self.config.heartbeat_ttl_s * 1000)

    # ---- life cycle ---------------------------------------------------------------------------
    def start(self, stop: threading.Event | None = None) -> None:
        """Serve, register and start the background duties. ``stop`` (its process's signals) ends
        a wait for the node id's record to free (StartCancelled)."""
        self.server.start()
        if self.config.advertise:  # the bound address is this agent's own; an advertised one may not be
            check_advertised(self.config.advertise, self.arena.name)
        register_first(self.index, self.node_info, incarnation=self.incarnation, ttl_ms=self._ttl_ms, stop=stop)
        remember_alloc_tag(self.index, self.node_id, self.alloc_tag)
        if evicting := self.index.eviction_unsafe():
            log.warning("%s", evicting)
        # The node id is this agent's now: arenas earlier agents of it left behind go, and those
        # of crashed agents of other ids that the node table no longer names.
        try:
            listed: frozenset[str] | None = frozenset(n.shm_name for n in self.index.nodes().values())
        except MooncakeError as exc:
            log.warning("could not read the node table to sweep abandoned arenas: %s", exc)
            listed = None
        for name in sweep_abandoned_segments(self.namespace, self.node_id, keep=self.arena.name, listed=listed):
            log.warning("removed the shared-memory arena %s, left by an agent that is gone", name)
        # The pressure pass's scripts, compiled now rather than on the first pass, whose first
        # spill would otherwise wait for them. Only a head start: a call loads a missing script
        # itself (NOSCRIPT), so a failure here must not stop an agent already registered.
        try:
            self.index.preload(("victims", "move_replicas", "evict"))
        except MooncakeError as exc:
            log.warning("could not load the pressure scripts ahead (they load on first use): %s", exc)
        duties = (
            ("mc-heartbeat", self._heartbeat_loop),
            ("mc-sync", self._sync_loop),
            ("mc-pressure", lambda: self.pressure.run(self._stop)),
        )
        for name, target in duties:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("agent %s serving %s, shm %s", self.node_id, self.server.endpoint, self.arena.name)

    def stop(self) -> None:
        """Leave the cluster: deregister (its replicas leave the index), stop serving, remove the arena."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._beat_now.set()
        self.pressure.wake()  # its loop waits on its own event, up to pressure_interval_s
        for thread in self._threads:
            thread.join(timeout=5)
        try:
            self.index.deregister_node(self.node_id, incarnation=self.incarnation)
        except MooncakeError as exc:
            log.warning("could not deregister %s: %s", self.node_id, exc)
        disk, gpu = self.disk, self.gpu
        steps: list[tuple[str, Callable[[], None]]] = [
            ("the server", self.server.stop),
            ("the pressure thread", self.pressure.close),
            ("the host arena", lambda: self.arena.close(unlink=True)),
            *([("the disk tier", lambda: disk.close(remove_files=True))] if disk is not None else []),
            *([("the GPU arena", gpu.close)] if gpu is not None else []),
            ("the index connection", self.index.close),
        ]
        # Every step runs whatever an earlier one raised: a server that failed to stop must not
        # leave the arena's segment in /dev/shm, or the disk files, behind the process.
        for what, step in steps:
            try:
                step()
            except Exception:
                log.exception("stopping %s of %s failed", what, self.node_id)

    def wait(self) -> None:
        self._stop.wait()

    def run_until(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set or the agent can no longer serve (:attr:`fatal`, then raised
        as MooncakeError). Polls: a timed wait keeps signal delivery prompt."""
        while not stop.wait(0.5):
            if self.fatal is not None:
                raise MooncakeError(self.fatal)

    # ---- background duties --------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        failures = FailureLog(log, "heartbeat")
        while True:
            # A sync that finds the index gone back wakes the loop: the reconcile comes at once.
            self._beat_now.wait(interval)
            if self._stop.is_set():
                return
            self._beat_now.clear()
            try:
                self.heartbeat_once()
                # Every agent reaps, at each heartbeat: a dead node's grace is its own TTL, which
                # may be shorter than this one's. With nothing due the script reads one sorted-set
                # range; else one agent per heartbeat interval purges (a turn).
                reaped = self.index.reap_dead_nodes(
                    older_grace_ms=self._ttl_ms,
                    reaper=self.incarnation,
                    turn_ms=int(self.config.heartbeat_interval_s * 1000),
                )
                if reaped:
                    log.info("reaped dead nodes %s", reaped)
                failures.succeeded()
            except ConnectError as exc:
                failures.failed(exc)
            except NodeIdTaken as exc:
                # Reaped while stalled, and its node id taken over since: this agent can never serve
                # again under it. It gives up its memory and says so; its process stops (fatal).
                log.error("node %s: %s; this agent holds nothing and stops", self.node_id, exc)
                self._drop_everything()
                self.fatal = f"node {self.node_id} was taken over by another agent while this one stalled: {exc}"
                return
            except MooncakeError as exc:
                # A script error (the server out of memory, busy, read-only in a failover): the
                # index still names this agent's objects, so it keeps them and tries again. Only
                # being reaped (heartbeat False) or taken over (NodeIdTaken) lets its memory go.
                failures.failed(exc)
            except Exception:
                log.exception("heartbeat failed unexpectedly")

    def heartbeat_once(self) -> None:
        """Extend this node's deadline and publish its use. Reaped while stalled, it finds its
        record gone: its replicas are gone from the index, so its memory holds nothing readable
        once the read leases on them end. It starts clean under the same incarnation rules. An
        index gone back in time is reconciled, then beaten again (a few times at most, should its
        record vanish meanwhile)."""
        with self._beat_lock:
            for _ in range(3):
                if self._beat():
                    return

    def _beat(self) -> bool:
        """One heartbeat; False when the record vanished while it reconciled (beat again)."""
        try:
            count = self._send_beat()
        except IndexWentBack as exc:
            return self._reconcile(exc)
        if count is not None:
            self._note_count(count)
            if self._hold_owed:
                # The registration after a vanished record ran, but its reply was lost (the index
                # timed out, or the connection broke too late to retry): what it would have said
                # of the doomed objects' leases never came, and their memory was held for good.
                # Held as for a record lost with no purge, then freed.
                self._hold_owed = False
                for table in self._tables():
                    table.hold_reaped({}, at_least_ms=VANISHED_HOLD_MS)
            return True
        log.warning("node record of %s vanished; registering again", self.node_id)
        self._drop_everything()
        self._hold_owed = True  # until register_again answers how long to hold what was doomed
        info = self.node_info()
        # The record goes on from well above this agent's count: a snapshot from before the reap
        # (whose count may exceed the agent's by calls whose replies were lost) is told apart.
        start = self._beats + REGISTER_COUNT_GAP
        register_again(
            self.index, info, incarnation=self.incarnation, ttl_ms=self._ttl_ms, tables=self._tables(), beats=start
        )
        self._hold_owed = False
        self._note_count(start)
        return True

    def _send_beat(self, *, reconciled: bool = False) -> int | None:
        """node_heartbeat with this agent's count (NodeTableCalls.heartbeat)."""
        return self.index.heartbeat(
            self.node_id,
            incarnation=self.incarnation,
            ttl_ms=self._ttl_ms,
            tiers=self.tiers(),
            last_beats=self._beats,
            reconciled=reconciled,
            interval_ms=max(1, int(self.config.heartbeat_interval_s * 1000)),
        )

    def _reconcile(self, went_back: IndexWentBack) -> bool:
        """The index was restored from an older snapshot (it counts fewer heartbeats and syncs than
        this agent was answered): it names replicas of memory freed (and maybe used again) since,
        pending puts and spill guards this agent revoked, and lacks objects committed since. This
        node's part of it is brought in line with its tables, while the index holds the node
        unreadable (the beat ended its deadline rather than extend it). Not between a sync's
        drained acks and its commits, nor a local move's fill and swap. Then a beat makes the node
        readable, its count going on from this agent's (never back: a later restore of a snapshot
        taken before it, even during the reconcile, is told apart too). Should the reconcile
        fail, the count stays, and the next beat finds the index behind again. False when the
        record vanished meanwhile."""
        with self._sync_lock, self.pressure.moves.gate.reconciling():
            dropped, revoked, disk_orphans = reconcile_after_rollback(
                self.index, self.node_id, self._tables(), set(self.disk_keys)
            )
            self.free_allocations(disk_orphans)
            count = self._send_beat(reconciled=True)
        log.error(
            "the index went back in time (%d heartbeats and syncs, %d answered before): dropped %d replica(s) "
            "and revoked %d pending put(s) and spill guard(s) it named here of memory %s no longer holds, "
            "freeing %d disk file(s) it no longer names",
            went_back.count, self._beats, dropped, revoked, self.node_id, len(disk_orphans),
        )  # fmt: skip
        if count is None:
            return False
        self._note_count(count)
        return True

    def _drop_everything(self) -> None:
        """After being reaped: committed objects are gone from the index, so their memory is free
        once the read leases on them end (held until register_node says when; see
        AllocationTable.drop_after_reap). Reservations of puts in flight are only expired: the next
        sync revokes their pending records (a late commit then fails) before freeing them, so no
        commit can land on reused memory."""
        with self._sync_lock:  # never between a sync's drained acks and its commits
            for table in self._tables():
                table.drop_after_reap()
            with self._spills_lock:
                self._spills_in_flight.clear()  # those reservations are gone with the rest
            if self.disk is not None:
                self.free_allocations(sorted(self.disk_keys))

    def _tables(self) -> list[AllocationTable]:
        """Every table of reservations, the host tier's first."""
        tables = [self.table]
        if self.gpu_table is not None:
            tables.append(self.gpu_table)
        if self.inbox is not None:
            tables.append(self.inbox.table)
        return tables

    def holds(self, alloc_id: int) -> bool:
        """Whether this agent holds ``alloc_id`` in any tier (asked per id by the sync's plan)."""
        return alloc_id in self.disk_keys or any(alloc_id in table for table in self._tables())
