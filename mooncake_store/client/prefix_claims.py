"""What one store holds while it writes the missing chunks of a prompt: the claims on those
chunks (prefix_claim.lua: concurrent stores of one prefix write each chunk once), and pins on the
stored chunks the claimed ones hang off.

Eviction takes only chunks that no stored chunk hangs off, so the last stored chunk of a chain
is a leaf until the store commits its children, and the store's own puts wake the pressure pass
that evicts leaves. Evicted then, the new chunks were committed under a parent that was gone:
unreachable by every match (which stops at the gap), taking memory until evicted in turn, while
store() reported them written. So the stored chunk just before each claimed run is pinned under
the writer's id for the claim's ttl, renewed and released with the claims. (A chunk just before a
run that another writer is storing, BUSY, cannot be pinned: if that writer fails, its children
still wait for the next store of the prompt.)
"""

from __future__ import annotations

import contextlib
import threading

from mooncake_store.errors import MooncakeError
from mooncake_store.index.prefix import PrefixIndex

#: Claim rounds when a parent went between the claim and its pin (it is then claimed and written too).
GUARD_TRIES = 3


def guards_of(keys: list[str], statuses: list[str]) -> list[str]:
    """The stored chunks that chunks this writer writes hang off: each HAVE just before a MINE."""
    return [keys[i - 1] for i in range(1, len(keys)) if statuses[i] == "MINE" and statuses[i - 1] == "HAVE"]


class Claims:
    """The chunks one store claimed and the parents it pinned, renewed while it writes them (a
    put may outlast the claim's ttl); ``released`` under ``lock``: no renewal after the release
    (it would claim them again)."""

    def __init__(self, index: PrefixIndex, keys: list[str], writer_id: str, ttl_ms: int) -> None:
        self.index = index
        self.all_keys = keys
        self.writer_id = writer_id
        self.ttl_ms = ttl_ms
        self.keys: list[str] = []  # claimed: this store writes them
        self.guards: list[str] = []  # pinned under writer_id
        self.lock = threading.Lock()
        self.released = False

    def claim(self) -> list[str]:
        """Claim the missing chunks and pin their parents; returns the status of every key
        (prefix_claim.lua). A parent evicted between the two round trips is missing at the next
        claim, so this writer writes it as well."""
        pinned: set[str] = set()
        try:
            # One round trip per 4096 chunks: a later one failing left the earlier ones' claims.
            statuses = self.index.claim(self.all_keys, writer_id=self.writer_id, ttl_ms=self.ttl_ms)
            for _ in range(GUARD_TRIES):
                wanted = [k for k in guards_of(self.all_keys, statuses) if k not in pinned]
                if not wanted:
                    break
                held = self.index.pin(wanted, pin_id=self.writer_id, lease_ms=self.ttl_ms)
                pinned.update(k for k, ok in zip(wanted, held, strict=True) if ok)
                if all(held):
                    break
                statuses = self.index.claim(self.all_keys, writer_id=self.writer_id, ttl_ms=self.ttl_ms)
        except BaseException:
            # A pin or claim that landed before the failure (an index hiccup, a close) would hold
            # its chunk for the ttl: nobody could remove it or write it meanwhile. Whatever may
            # have landed goes back, as far as the index answers.
            with contextlib.suppress(MooncakeError):
                self.index.release(self.all_keys, writer_id=self.writer_id)
            raise
        self.keys = [k for k, s in zip(self.all_keys, statuses, strict=True) if s == "MINE"]
        self.guards = sorted(pinned)
        return statuses

    def renew(self) -> None:
        """Renew the claims and the parents' pins (the renewal thread, under ``lock``)."""
        self.index.claim(self.keys, writer_id=self.writer_id, ttl_ms=self.ttl_ms)
        if self.guards:
            self.index.pin(self.guards, pin_id=self.writer_id, lease_ms=self.ttl_ms)

    def release(self) -> int:
        """Drop the claims and unpin the parents, one round trip (prefix_release.lua)."""
        with self.lock:
            self.released = True
        return self.index.release(self.keys + self.guards, writer_id=self.writer_id)
