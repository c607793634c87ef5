"""Writing a put's replicas once their room is reserved (client/puts.py): same-host ones by memcpy
into the agent's shared arena under its fence (FENCE, copy, UNFENCE: the agent answers which
reservations it still held), device ones through CUDA IPC, the rest over TCP, the agent hashing
what landed (DIGEST, sent behind the WRITE). Each records the checksum of its bytes as they landed
in its plan. A write that fails at its agent (which died or broke after granting the room) names
the node (ReplicaWriteFailed), so that PutPath.run places the put again without it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from mooncake_store.client.buffers import Source
from mooncake_store.errors import ConnectError, MooncakeError, ReservationExpired, StaleLocation, TransferError
from mooncake_store.transport import frames
from mooncake_store.transport.fence import GPU_FENCE_LABEL, Fence
from mooncake_store.types import NodeInfo, Replica, TransportKind

if TYPE_CHECKING:
    from mooncake_store.client.client import Client
    from mooncake_store.client.device import DeviceSource
    from mooncake_store.client.put_plans import PlannedPut

log = logging.getLogger("mooncake.client")


def checksum_of(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view)


@dataclass(slots=True)
class FencedPart:
    """Same-host puts into one agent's arena, with the Fence that covers their copies."""

    node: NodeInfo
    puts: list[tuple[Replica, PlannedPut]]
    fence: Fence


class ReplicaWriteFailed(Exception):
    """A replica's write failed at its agent (``error``): PutPath.run places the put again without
    ``node_id``. Never seen outside the put path."""

    def __init__(self, node_id: str, error: MooncakeError) -> None:
        super().__init__(f"{node_id}: {error}")
        self.node_id = node_id
        self.error = error


@contextlib.contextmanager
def failing_node(node_id: str) -> Iterator[None]:
    """A replica write (or its fence's reply) that fails at its agent, which died or broke after
    granting the room, as ReplicaWriteFailed naming the node. A reservation the agent no longer
    holds (StaleLocation, ReservationExpired) is no failure of the node: it stays as it is."""
    try:
        yield
    except StaleLocation:
        raise
    except (TransferError, ConnectError) as exc:
        raise ReplicaWriteFailed(node_id, exc) from exc


@contextlib.contextmanager
def reservation_held(node: NodeInfo, plan: PlannedPut) -> Iterator[None]:
    """A WRITE (or its DIGEST) that the agent answers STALE: it freed the reservation first (the
    writer outlived its reserve timeout, or the agent let it go at a reap). That is the put's
    ReservationExpired, placed again by PutPath.run as the same case over shm is, not a reader's
    StaleLocation raised to the caller."""
    try:
        yield
    except StaleLocation as exc:
        raise ReservationExpired(
            f"the reservation for {plan.key!r} on {node.node_id} was freed before its bytes landed ({exc}); "
            f"a write that outlives the agent's reserve_timeout_s is void"
        ) from None


class ReplicaWriter:
    """The byte-moving half of PutPath: one per client."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def arena_mapped(self, node: NodeInfo) -> bool:
        """Map the node's shared arena (once; the later calls find it mapped); False when this
        process cannot (no room in its address space, no descriptor left) and TCP may carry the
        put instead, as the agents' own peer mappings fall back. The failure was the put's: a
        bare OSError, or a write that failed on the node and placed the put elsewhere."""
        client = self.client
        try:
            client._shm.segment(node.shm_name, client._arena_bytes(node))
        except ConnectError as exc:
            if TransportKind.TCP not in client.transports:
                raise
            log.info("put to %s over TCP: its arena cannot be mapped here (%s)", node.node_id, exc)
            return False
        return True

    def fence(self, node: NodeInfo, group: list[tuple[Replica, PlannedPut]]) -> list[FencedPart]:
        """Send the FENCEs of same-host puts into one agent's shared arena (one per MAX_BATCH of
        them, each on a connection of its own); copy_fenced reads each reply and copies. The
        arena is mapped first: mapping a large one must not happen while fences are held."""
        client = self.client
        client._shm.segment(node.shm_name, client._arena_bytes(node))
        peer = client._tcp.peer(node.tcp_endpoint)
        parts: list[FencedPart] = []
        try:
            for start in range(0, len(group), frames.MAX_BATCH):
                part = group[start : start + frames.MAX_BATCH]
                parts.append(FencedPart(node, part, Fence(peer, [r.alloc_id for r, _ in part], node.shm_name)))
        except BaseException:
            for made in parts:
                made.fence.abort()
            raise
        return parts

    @staticmethod
    def check_landed(part: FencedPart) -> None:
        """Read a part's UNFENCE reply; ReservationExpired (the put is placed again) when the agent
        freed one of its reservations while it was fenced (what was copied into it is void)."""
        still = part.fence.finish()
        gone = [plan.key for replica, plan in part.puts if not still.get(replica.alloc_id, True)]
        if gone:
            raise ReservationExpired(
                f"{len(gone)} reservation(s) on {part.node.node_id} were freed while their bytes were "
                f"copied (first key {gone[0]!r})"
            )

    def copy_fenced(self, part: FencedPart) -> None:
        """Same-host puts, each one memcpy into the agent's arena, into the reservations the agent
        fenced: one it freed meanwhile (this writer stalled past its timeout, or the agent was
        reaped and let its reservations go) is not written, so the bytes never land in a block
        handed to another object. Raises ReservationExpired (the put is placed again) when a
        reservation was gone."""
        client, node = self.client, part.node
        fenced = part.fence.fenced()
        if fenced is None:
            # The agent and the segment its row names are not the same (say, an advertise address
            # that reaches another agent's namesake): its own transport, TCP, still is.
            if TransportKind.TCP not in client.transports:
                raise TransferError(
                    f"agent {node.node_id} does not own segment {node.shm_name}, and this client's transports "
                    f"{tuple(str(t) for t in client.transports)} do not allow writing to it over tcp"
                )
            log.warning("agent %s does not own segment %s; writing over TCP", node.node_id, node.shm_name)
            for replica, plan in part.puts:
                self.write_tcp(node, replica, plan, plan.source.view)  # type: ignore[union-attr]  # a Source
            return
        if not all(fenced):
            raise ReservationExpired(
                f"{fenced.count(False)} reservation(s) on {node.node_id} were gone before their bytes landed "
                f"(first key {part.puts[fenced.index(False)][1].key!r})"
            )
        for replica, plan in part.puts:
            view = plan.source.view  # type: ignore[union-attr]
            try:
                plan.landed.append(
                    client._shm.write_from(node.shm_name, client._arena_bytes(node), replica.offset, view)
                )
            except OSError as exc:  # the segment could not be mapped again (unmapped meanwhile)
                raise TransferError(f"copy of {plan.key!r} into {node.shm_name} failed: {exc}") from None

    def write_replica(self, node: NodeInfo, replica: Replica, plan: PlannedPut) -> None:
        client = self.client
        if plan.size_bytes == 0:
            return
        src = plan.source
        if not isinstance(src, Source):
            try:
                if GPU_FENCE_LABEL in node.labels:
                    self._write_device_fenced(node, replica, plan, src)
                else:  # an agent that predates GPU fences: copied unfenced, as it always was
                    client._gpu_segments().write(node, replica, src.pointer, src.size_bytes)
                return
            except TransferError as exc:
                # The IPC mapping failed (GpuSegments remembers it): the agent takes the bytes over
                # TCP into its GPU reservation instead, staged through host memory once, if allowed.
                if TransportKind.TCP not in client.transports:
                    raise
                from mooncake_store.client.device import to_host_bytes

                log.info("device put of %s through CUDA IPC failed (%s); sending it over TCP", plan.key, exc)
                staged = memoryview(to_host_bytes(src))
                with reservation_held(node, plan):
                    client._tcp.write_from(node.tcp_endpoint, replica.alloc_id, replica.offset, staged)
        else:
            # Over TCP the agent fences the reservation while the payload arrives (same-host writes
            # into its shared arena go through fence and copy_fenced).
            self.write_tcp(node, replica, plan, src.view)

    def _write_device_fenced(self, node: NodeInfo, replica: Replica, plan: PlannedPut, src: DeviceSource) -> None:
        """A device put into a same-host agent's GPU tier through CUDA IPC, under the agent's fence
        as a host copy is: a reservation it freed meanwhile (this writer stalled past its timeout)
        is not written, so the bytes never land in a block granted to another object, and one
        freed while fenced voids the put. Unfenced, such a put was reported stored over the other
        object's bytes. ReservationExpired places it again; TransferError falls back to TCP."""
        part = FencedPart(
            node, [(replica, plan)], Fence(self.client._tcp.peer(node.tcp_endpoint), [replica.alloc_id], node.shm_name)
        )
        try:
            fenced = part.fence.fenced()
            if fenced is None:
                raise TransferError(f"agent {node.node_id} does not own segment {node.shm_name}")
            if not fenced[0]:
                raise ReservationExpired(
                    f"the GPU reservation for {plan.key!r} on {node.node_id} was gone before its bytes landed"
                )
            self.client._gpu_segments().write(node, replica, src.pointer, src.size_bytes)
            part.fence.unfence()
            self.check_landed(part)  # freed while fenced: the copy is void
        except BaseException:
            part.fence.abort()  # the agent lifts the fence as the connection closes
            raise

    def write_tcp(self, node: NodeInfo, replica: Replica, plan: PlannedPut, view: memoryview) -> None:
        """Send a host source over TCP; the agent hashes what landed (DIGEST, behind the WRITE)."""
        with reservation_held(node, plan):
            checksum = self.client._tcp.write_from(
                node.tcp_endpoint, replica.alloc_id, replica.offset, view, digest=True
            )
        if checksum is None:
            # An agent that predates DIGEST: the source's hash after the send, right if the value
            # was left alone as documented (what every put committed before DIGEST).
            log.info("agent %s does not take DIGEST; hashing the source of %s", node.node_id, plan.key)
            checksum = checksum_of(view)
        plan.landed.append(checksum)
