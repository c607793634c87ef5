"""Spilling to a peer on this host: a host batch goes by memcpy into the peer's shared arena
instead of WRITEs (``agent.spill_shm``; DESIGN.md §4: shm before tcp), under the peer's fence. On
one connection: FENCE the batch's reservations (the peer answers which it holds, and the digest of
its arena's name: the bytes go into the arena that holds them, not an earlier incarnation's), copy
into the fenced ones, UNFENCE (the peer answers which are still live; one freed meanwhile is only
doomed, not re-granted). The peer's arena is mapped on the first spill to it or ahead of it
(agent/peer_arenas.py), and unmapped when the peer leaves the node table. Reservations, the swap
and the free are agent/spill.py's, as for a batch sent over TCP."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from mooncake_store.agent.peer_arenas import PeerArenas
from mooncake_store.agent.spill_jobs import PeerTrouble, Reserved
from mooncake_store.errors import MooncakeError
from mooncake_store.tiers.host import SharedSegment
from mooncake_store.transport.shm import copy_bytes
from mooncake_store.transport.tcp import TcpTransport
from mooncake_store.types import NodeInfo

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent

log = logging.getLogger("mooncake.agent")


class ArenaCopies:
    """A spiller's copies into same-host peers' arenas. Shares the spiller's transport (the fences
    go over its connections to the peer) and its record of peers in trouble."""

    def __init__(self, agent: Agent, transport: TcpTransport, trouble: PeerTrouble, *, streams: int) -> None:
        self.agent = agent
        self.transport = transport
        self._trouble = trouble
        self._streams = max(1, streams)
        #: Same-host peers' shared arenas, where host batches to them go by memcpy.
        self.arenas = PeerArenas(agent)
        # The copies' streams beside the spilling thread: a pool apart from the WRITE streams'
        # (agent/spill_writes.py), which stay up for a whole spill, so neither waits for the other's.
        self._pool = ThreadPoolExecutor(max_workers=max(1, self._streams - 1), thread_name_prefix="mc-spill")

    def close(self) -> None:
        self.arenas.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def copy_batch(self, segment: SharedSegment, peer_node: NodeInfo, reserved: Reserved) -> tuple[list[bool], bool]:
        """A host batch into a same-host peer's arena: (written per job, the connection broke)."""
        try:
            return self.copy_all(segment, peer_node, reserved), False
        except MooncakeError as exc:  # the connection broke: the peer lifts the fences itself
            log.info("spill to %s failed mid-copy: %s", peer_node.node_id, exc)
            self._trouble.note(peer_node.tcp_endpoint, exc)
            self.transport.drop_peer(peer_node.tcp_endpoint)
            return [False] * len(reserved.batch), True

    def _on_streams(self, count: int, stream: Callable[[int], None]) -> bool:
        """Run ``stream(k)`` for k in 0..count at once: the first on this thread, the rest on the
        pool. Returns whether one failed (each failure is logged)."""
        futures = [self._pool.submit(stream, k) for k in range(1, count)]
        failed = False
        try:
            if count > 0:
                stream(0)
        finally:
            for fut in futures:
                exc = fut.exception()
                if exc is not None:
                    log.warning("spill stream failed: %r", exc)
                    failed = True
        return failed

    def copy_all(self, segment: SharedSegment, peer_node: NodeInfo, reserved: Reserved) -> list[bool]:
        """A host batch into a same-host peer's arena under its fence, one memcpy per job (numpy
        releases the GIL, so the streams copy in parallel). Returns written per job: fenced by the
        peer, copied, and still held by the peer when the fence was lifted. Nothing is copied when
        the fencing agent's arena is not the mapped one (the peer restarted since the node table was
        read: its reservations are in a new arena)."""
        arena = self.agent.arena
        batch, reservations = reserved.batch, reserved.reservations

        def copy(fenced: list[bool]) -> list[bool]:
            copied = [False] * len(batch)

            streams = min(self._streams, len(batch))

            def stream(k: int) -> None:
                for i in range(k, len(batch), streams):
                    if not fenced[i]:
                        continue
                    job, res = batch[i], reservations[i]
                    size = job.wire_bytes
                    if size:
                        try:
                            dest = segment.view(res.offset, size)  # outside the peer's arena: refused
                        except MooncakeError as exc:
                            log.warning("spill of %s to %s: %s", job.victim.key, peer_node.node_id, exc)
                            continue
                        src = arena.view(job.offset, size)
                        try:
                            copy_bytes(dest, src)
                        finally:
                            dest.release()
                            src.release()
                    copied[i] = True

            self._on_streams(streams, stream)  # a job whose copy failed stays uncopied
            return copied

        peer = self.transport.peer(peer_node.tcp_endpoint)
        landed = peer.fenced([r.alloc_id for r in reservations], segment.name, copy)
        if landed is None:
            log.info("spill to %s: its arena is not %s any more; nothing copied", peer_node.node_id, segment.name)
            return [False] * len(batch)
        return landed
