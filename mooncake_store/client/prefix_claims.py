"""What one store holds while it writes the missing chunks of a prompt: the claims on those
chunks (prefix_claim.lua: concurrent stores of one prefix write each chunk once), and pins on the
stored chunks the claimed ones hang off.

Eviction takes only chunks that no stored chunk hangs off, so the last stored chunk of a chain
is a leaf until the store commits its children, and the store's own puts wake the pressure pass
that evicts leaves. Evicted then, the new chunks were committed under a parent that was gone:
unreachable by every match (which stops at the gap), taking memory until evicted in turn, while
store() reported them written. So the stored chunk just before each claimed run is pinned under
the writer's id for the claim's ttl, renewed and released with the claims.

A chunk just before a claimed run that another writer is storing (BUSY) cannot be pinned yet, and
it was left unpinned: that writer committed it, a pressure pass evicted it (still a leaf), and
this store committed its run under the gap; or that writer died and never committed it. So the
store waits for it (a claim round trip per poll, which also renews this writer's claims): stored,
it is pinned like any parent; its claim run out, this writer claims and writes it. Still BUSY
when the wait ends, the chunks that would hang off it are not written and their claims go back
at once (the next store of the prompt writes them): the index never holds a chunk committed under
a parent that is not there, and chains stay prefix-closed without a second lookup per match.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from mooncake_store.errors import MooncakeError
from mooncake_store.index.prefix import PrefixIndex

#: Claim rounds when a parent went between the claim and its pin (it is then claimed and written too).
GUARD_TRIES = 3
#: Polls of a BUSY parent: the first after this long, each one twice as long as the last, up to
#: POLL_MAX_S (and a third of the claim ttl: each poll renews this writer's claims).
POLL_FIRST_S = 0.01
POLL_MAX_S = 0.2


def guards_of(keys: list[str], statuses: list[str]) -> list[str]:
    """The stored chunks that chunks this writer writes hang off: each HAVE just before a MINE."""
    return [keys[i - 1] for i in range(1, len(keys)) if statuses[i] == "MINE" and statuses[i - 1] == "HAVE"]


def first_orphan(statuses: list[str]) -> int | None:
    """The first chunk this writer claimed whose parent another writer is storing (a MINE just
    after a BUSY), or None."""
    return next((i for i in range(1, len(statuses)) if statuses[i] == "MINE" and statuses[i - 1] == "BUSY"), None)


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
        self.given_up: list[str] = []  # claimed, then let go: they would hang off a BUSY chunk
        self.lock = threading.Lock()
        self.released = False

    def claim(self, *, wait_s: float = 0.0, sleep: Callable[[float], None] = time.sleep) -> list[str]:
        """Claim the missing chunks and pin their parents; returns the status of every key
        (prefix_claim.lua). A parent evicted between the two round trips is missing at the next
        claim, so this writer writes it as well. A parent another writer is storing is waited for,
        up to ``wait_s`` (``sleep`` waits between polls and may raise to cut the wait short); the
        chunks still hanging off one at the end are given up: their status is then 'BUSY'."""
        pinned: set[str] = set()
        try:
            # One round trip per 4096 chunks: a later one failing left the earlier ones' claims.
            statuses = self._claim_and_pin(pinned)
            deadline = time.monotonic() + wait_s
            delay = POLL_FIRST_S
            while (cut := first_orphan(statuses)) is not None and (left := deadline - time.monotonic()) > 0:
                # The chunks claimed ahead of the wait go back while it lasts (each poll claims
                # again what is still missing): held unwritten, one of them could be the parent
                # another store of the prompt waits for, while this one waits for that store's
                # chunk, and both waited out timeout_s.
                ahead = [k for k, s in zip(self.all_keys[:cut], statuses[:cut], strict=True) if s == "MINE"]
                if ahead:
                    self.index.release(ahead, writer_id=self.writer_id)
                sleep(min(delay, left))
                delay = min(2 * delay, POLL_MAX_S, self.ttl_ms / 3000)
                statuses = self._claim_and_pin(pinned)
            cut = first_orphan(statuses)
            if cut is not None:
                # Written, they would be committed under a chunk that may never be stored (or be
                # evicted first): unreachable, taking space. Their claims go back now, so that
                # the next store of the prompt writes them, not waits out this one.
                given_up = [k for k, s in zip(self.all_keys[cut:], statuses[cut:], strict=True) if s == "MINE"]
                self.index.release(given_up, writer_id=self.writer_id)
                self.given_up = given_up
                statuses = statuses[:cut] + ["BUSY" if s == "MINE" else s for s in statuses[cut:]]
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

    def _claim_and_pin(self, pinned: set[str]) -> list[str]:
        """One claim of every key, and pins (renewed) on the parents of the claimed runs, adding
        them to ``pinned``; claimed again while a pin finds its parent gone (it is then MINE)."""
        statuses = self.index.claim(self.all_keys, writer_id=self.writer_id, ttl_ms=self.ttl_ms)
        for _ in range(GUARD_TRIES):
            # Every parent, those pinned before too: a wait's polls renew their pins.
            wanted = guards_of(self.all_keys, statuses)
            if not wanted:
                break
            held = self.index.pin(wanted, pin_id=self.writer_id, lease_ms=self.ttl_ms)
            pinned.update(k for k, ok in zip(wanted, held, strict=True) if ok)
            if all(held):
                break
            statuses = self.index.claim(self.all_keys, writer_id=self.writer_id, ttl_ms=self.ttl_ms)
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
