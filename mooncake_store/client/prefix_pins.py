"""Pins of prefix hits dropped without release(): unpinned by their cache, not left to their lease.

A hit dropped without release() (no ``with``, no call) kept its chunks pinned for its whole lease
(``pin_lease_s``, 30 s by default): an engine that forgot one release per request kept much of a
node pinned, and no pressure pass could move or evict those chunks meanwhile. A finalizer queues
the pins of a dropped hit, and the cache unpins them at its next load, store or match, within a
quarter second on its renewal thread (DROPPED_EVERY_S), and at close(). The finalizer
only queues: it may run inside any thread's code (at a garbage collection), so it takes no lock
and makes no index call.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING

from mooncake_store.errors import MooncakeError
from mooncake_store.index.prefix import PrefixIndex

if TYPE_CHECKING:
    from mooncake_store.client.prefix import PrefixCache, PrefixHit


#: Dropped hits unpinned by one call of the cache at most (one round trip each).
UNPINS_AT_ONCE = 64
#: How often the renewal thread unpins hits dropped without release() between its renewals.
DROPPED_EVERY_S = 0.25


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


def renew_while_alive(
    cache_ref: weakref.ref[PrefixCache], dropped: DroppedHits, stop: threading.Event, interval_s: float
) -> None:
    """Every third of the shorter of the pin lease and the claim ttl: the pins of the hits held and
    the claims of the stores under way, so that neither runs out while its owner is alive (a put
    longer than the claim's ttl let another writer claim and write the same chunks). Ends with the
    cache's close() or its client's (a closed client renews nothing: the pins and claims run out by
    their leases), or once the cache is collected, dropped without close(): it holds the cache only
    for a renewal, so that the cache can go. A hit dropped unreleased with its cache (a cache per
    request) queued its pins in the cache's queue, which nothing else would drain: they are unpinned
    here, not left pinned for their whole lease."""
    next_renewal = time.monotonic() + interval_s
    while not stop.wait(min(DROPPED_EVERY_S, max(0.0, next_renewal - time.monotonic()))):
        cache = cache_ref()
        if cache is None:
            dropped.unpin(every=True)
            return
        if time.monotonic() >= next_renewal:
            next_renewal = time.monotonic() + interval_s
            cache._renew_once()
        else:
            # Between renewals, the hits dropped meanwhile (no round trip when there are none): a
            # load_async its caller cancelled while it ran finished all the same, and its hit,
            # which no one could release, kept its chunks pinned (unremovable, unevictable) until
            # the next renewal, 10 s by default.
            dropped.unpin()
        del cache
