"""Pins of prefix hits dropped without release(): unpinned by their cache, not left to their lease.

A hit dropped without release() (no ``with``, no call) kept its chunks pinned for its whole lease
(``pin_lease_s``, 30 s by default): an engine that forgot one release per request kept much of a
node pinned, and no pressure pass could move or evict those chunks meanwhile. A finalizer queues
the pins of a dropped hit, and the cache unpins them at its next load, store or match, within a
quarter second on its renewal thread (prefix.DROPPED_EVERY_S), and at close(). The finalizer
only queues: it may run inside any thread's code (at a garbage collection), so it takes no lock
and makes no index call.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING

from mooncake_store.errors import MooncakeError
from mooncake_store.index.prefix import PrefixIndex

if TYPE_CHECKING:
    from mooncake_store.client.prefix import PrefixHit


#: Dropped hits unpinned by one call of the cache at most (one round trip each).
UNPINS_AT_ONCE = 64


class DroppedHits:
    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self._queue: deque[tuple[str, list[str]]] = deque()  # (pin id, keys) of hits dropped

    def watch(self, hit: PrefixHit) -> weakref.finalize:
        """Queue ``hit``'s pins once it is collected; its release() detaches the returned finalizer.
        Every key it pinned, even those a load cut from it later (unpinning one again is a no-op)."""
        on_drop = weakref.finalize(hit, self._queue.append, (hit.pin_id, list(hit.keys)))
        on_drop.atexit = False  # at exit the pins run out by their lease
        return on_drop

    def unpin(self, *, every: bool = False) -> int:
        """Unpin the chunks of the hits dropped so far, one round trip per hit, up to UNPINS_AT_ONCE
        (the rest at the next call), or all of them (``every``: at close, when no next call comes);
        returns how many. The first that fails ends it: the index is out of reach, and a call must
        not wait out its timeout once per dropped hit."""
        done = 0
        while self._queue and (every or done < UNPINS_AT_ONCE):
            try:
                pin_id, keys = self._queue.popleft()
            except IndexError:  # another thread took the last one
                break
            done += 1
            try:
                self._index.unpin(keys, pin_id=pin_id)
            except MooncakeError:
                break  # unreachable: this hit's pins run out by their lease, the others wait
        return done
