"""FENCE and UNFENCE on one pooled connection (PeerConnections): how a same-host writer copies into
an agent's shared arena (or, through CUDA IPC, its GPU tier) itself, only into reservations the
agent fenced, and learns afterwards which of them were still live (agent/ops.py answers both;
DESIGN.md §3.3)."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mooncake_store.errors import InvalidValue, ProtocolError, TransferError
from mooncake_store.tiers.host import segment_digest
from mooncake_store.transport import frames
from mooncake_store.transport.frames import Op, Status

if TYPE_CHECKING:
    from mooncake_store.transport.tcp import PeerConnections

#: A node-table label of agents whose FENCE covers GPU-tier reservations as well as host ones.
GPU_FENCE_LABEL = "gpu_fence"


class Fence:
    """FENCE and UNFENCE of one batch of host-tier (or GPU-tier) reservations on one connection to a same-host
    agent, for a writer that copies into the agent's shared arena itself. The FENCE goes out when
    the Fence is made and the UNFENCE with unfence(), each before its reply is read (fenced(),
    finish()): a writer overlaps them with its own index round trips. Fences last until the
    UNFENCE or until the connection closes, which abort() does (and the agent does when the writer
    dies). The connection goes back to the pool only once both replies are read."""

    def __init__(self, peer: PeerConnections, alloc_ids: Sequence[int], shm_name: str) -> None:
        self.ids = list(alloc_ids)
        if not 0 < len(self.ids) <= frames.MAX_BATCH:
            raise InvalidValue(f"{len(self.ids)} reservations to fence; 1..{frames.MAX_BATCH} per call")
        self._peer = peer
        self._shm_name = shm_name
        self._held: list[int] = []
        self._sock: socket.socket | None = peer._acquire()
        self._send(Op.FENCE, self.ids)

    def fenced(self) -> list[bool] | None:
        """The FENCE reply: per id whether the agent fenced it (a live reservation, not being freed);
        None when the agent's arena is not the segment the writer maps (the reply names it by
        digest): nothing may be copied, and unfence() lifts what was fenced."""
        digest, flags = self._read(Op.FENCE, len(self.ids))
        self._held = [x for x, f in zip(self.ids, flags, strict=True) if f]
        return flags if digest == segment_digest(self._shm_name) else None

    def unfence(self) -> None:
        """Send the UNFENCE of every fenced id; finish() reads its reply."""
        if self._held:
            self._send(Op.UNFENCE, self._held)

    def finish(self) -> dict[int, bool]:
        """The UNFENCE reply: per fenced id whether its reservation was still live (False: freed
        meanwhile, so what was copied into it is void). The connection goes back to the pool."""
        still: dict[int, bool] = {}
        if self._held:
            _, flags = self._read(Op.UNFENCE, len(self._held))
            still = dict(zip(self._held, flags, strict=True))
        sock, self._sock = self._sock, None
        if sock is not None:
            self._peer._release(sock)
        return still

    def abort(self) -> None:
        """Close the connection: the agent lifts every fence it held. Safe to call at any point."""
        sock, self._sock = self._sock, None
        if sock is not None:
            self._peer._drop(sock)

    def _send(self, op: Op, ids: list[int]) -> None:
        self._use(frames.send_all, frames.pack(op, len(ids)), memoryview(frames.pack_ids(ids)))

    def _read(self, op: Op, count: int) -> tuple[int, list[bool]]:
        def run(sock: socket.socket) -> tuple[int, list[bool]]:
            status, a, got, _ = self._peer._reply(sock, op)
            if status != Status.OK or got != count:
                where = self._peer.endpoint
                raise ProtocolError(f"agent at {where} answered {op.name} with status {status}, {got} ids")
            return a, [bool(x) for x in self._peer.recv_exact_within(sock, count)]

        result: tuple[int, list[bool]] = self._use(run)
        return result

    def _use(self, func, *args):  # type: ignore[no-untyped-def]
        """``func(sock, *args)`` on the held connection; on an error it is closed (PeerConnections._on)
        and the Fence holds none any more."""
        if self._sock is None:
            raise TransferError(f"the fence's connection to agent at {self._peer.endpoint} is closed")
        try:
            return self._peer._on(self._sock, func, *args)
        except BaseException:
            self._sock = None
            raise
