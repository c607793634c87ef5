"""What this client has reserved on each node since that node last published its use.

A put ranks nodes by the free room in the node table, and a row there is as old as its agent's
last heartbeat (up to ``heartbeat_interval_s``), read into a copy that is itself up to
NODE_TABLE_TTL_S old (node_view.py). A writer putting in a loop saw the same free room for every
put in that time and sent them all to the same nodes: with ``replicas=2`` on three nodes of 64 MiB,
60 puts of 1 MiB went to two of them, which passed their high watermarks and spilled to and fro
while the third stayed nearly empty. So each reservation is noted here with the index's time it
was made at, and the ranking takes off a node's free room what this client reserved there after
the node's row was published (``NodeInfo.last_heartbeat_ms``): the puts of one writer spread as
one batch's objects do (Reserver.reserve: free room projected after its earlier objects).

Reservations revoked since (a put that failed) are still counted until the node's next heartbeat:
the room looks smaller than it is for that long, never larger. Other writers' puts are not seen,
as before.
"""

from __future__ import annotations

import threading
from collections import deque

from mooncake_store.types import NodeInfo, TierKind, footprint_bytes

#: Reservations older than this are dropped unread: every live node has heartbeated since (an
#: interval is at most an hour: config checks), and a row that old belongs to a node past its
#: deadline, which no put goes to.
KEEP_MS = 3_600_000
#: At most this many reservations are kept per node and tier (the oldest go first): a writer of
#: tiny objects at a high rate must not grow the ledger without bound.
MAX_ENTRIES = 16_384


class PlacedSince:
    """Per node and tier, the reservations not yet in its row, oldest first, and their sum: a
    ranking reads a sum per node, and drops what the row now shows, whatever the put rate.
    Thread-safe: puts on several threads note and read it at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (node id, tier) -> (index ms when reserved, bytes it takes there), oldest first.
        self._entries: dict[tuple[str, TierKind], deque[tuple[int, int]]] = {}
        self._sums: dict[tuple[str, TierKind], int] = {}

    def note(self, node_id: str, tier: TierKind, size_bytes: int, *, at_ms: int) -> None:
        """A reservation of ``size_bytes`` granted on ``node_id``'s ``tier`` at ``at_ms`` (the
        index's time, as the node table's heartbeat times are)."""
        taken = footprint_bytes(size_bytes)
        where = (node_id, tier)
        with self._lock:
            entries = self._entries.setdefault(where, deque())
            entries.append((at_ms, taken))
            self._sums[where] = self._sums.get(where, 0) + taken
            if len(entries) > MAX_ENTRIES:
                self._sums[where] -= entries.popleft()[1]

    def unseen(self, nodes: dict[str, NodeInfo], tier: TierKind, *, now_ms: int) -> dict[str, int]:
        """The bytes reserved on each of ``nodes``' ``tier`` since its row was published, by node id
        (nodes with none are left out)."""
        out: dict[str, int] = {}
        with self._lock:
            for where, entries in list(self._entries.items()):
                node = nodes.get(where[0])
                # What the row shows already (reserved before it was published), and what is too
                # old to matter for a node this table does not list.
                since = node.last_heartbeat_ms if node is not None else now_ms - KEEP_MS
                while entries and entries[0][0] < since:
                    self._sums[where] -= entries.popleft()[1]
                if not entries:
                    del self._entries[where], self._sums[where]
                elif where[1] == tier and node is not None:
                    out[where[0]] = self._sums[where]
        return out
