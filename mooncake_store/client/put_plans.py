"""What a put plans for each object before it reserves anything: the object's source, its put id,
the replicas it was given, its chain metadata (checked here, before the index can store it), and the
checksum it commits once its bytes have landed. Used by client/puts.py and client/replica_writes.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake_store.client.buffers import Source
from mooncake_store.client.replica_writes import checksum_of
from mooncake_store.errors import InvalidKey, InvalidValue
from mooncake_store.index.client import PendingPut
from mooncake_store.types import Replica, TierKind, as_count, check_key

if TYPE_CHECKING:
    from mooncake_store.client.device import DeviceSource


@dataclass(slots=True)
class PlannedPut:
    key: str
    source: Source | DeviceSource
    put_id: bytes
    replicas: list[Replica] = field(default_factory=list)
    chain_pos: int | None = None
    chain_parent: str | None = None
    tier: TierKind = TierKind.HOST
    assigned: set[str] = field(default_factory=set)  # nodes this attempt placed a replica on
    #: Nodes whose agent failed a write of this put (died or broke after its RESERVE): later
    #: attempts place the replica elsewhere, since the node table lists a dead node until its
    #: heartbeat deadline.
    avoid: set[str] = field(default_factory=set)
    landed: list[int] = field(default_factory=list)  # checksum of each replica's bytes as they landed

    def checksum(self) -> int:
        """The checksum to commit: that of the bytes as they landed, the same for every replica.
        0 for device sources (hashing would cost a device-to-host copy). InvalidValue when the
        replicas differ: the value changed between their copies."""
        src = self.source
        if not isinstance(src, Source):
            return 0
        if not src.view:
            return checksum_of(src.view)  # nothing was written: nothing could change
        sums = set(self.landed)
        if len(sums) > 1:
            raise InvalidValue(
                f"the value of key {self.key!r} changed while it was put: its {len(self.replicas)} replicas "
                f"landed with different bytes (checksums {sorted(sums)}), so nothing was stored; a value "
                "must not change until put returns or put_async's future is done"
            )
        assert len(self.landed) == len(self.replicas), "a replica was committed with no checksum"
        return sums.pop()

    @property
    def size_bytes(self) -> int:
        src = self.source
        return len(src.view) if isinstance(src, Source) else src.size_bytes

    @property
    def dtype(self) -> str:
        return self.source.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    def pending(self) -> PendingPut:
        """The index record of this put between reserve and commit. Its checksum is 0: the bytes
        have not landed yet, and put_commit carries theirs."""
        return PendingPut(
            put_id=self.put_id.hex(),
            key=self.key,
            size_bytes=self.size_bytes,
            dtype=self.dtype,
            shape=self.shape,
            checksum=0,
            replicas=tuple(self.replicas),
            chain_pos=self.chain_pos,
            chain_parent=self.chain_parent,
        )


#: Largest chain position: the index's scripts print numbers with 14 significant digits.
MAX_CHAIN_POS = 10**14 - 1


def check_chain_meta(items: object, chain_pos: object, chain_parent: object) -> None:
    """``items`` a mapping of keys to values; ``chain_pos`` a mapping of keys to positions (ints
    in 0..MAX_CHAIN_POS) and ``chain_parent`` of keys to keys, or None. Checked before anything is
    reserved: a bad position stored in the index would stop the agent's eviction (its victim sample
    reads it as an int), and a bad parent would half-commit the object."""
    if not isinstance(items, Mapping):
        raise InvalidValue(f"put_many takes a mapping of key -> value, got {type(items).__name__}")
    for name, given in (("chain_pos", chain_pos), ("chain_parent", chain_parent)):
        if given is not None and not isinstance(given, Mapping):
            raise InvalidValue(f"{name} must be a mapping of key -> value or None, got {type(given).__name__}")
    for name, given in (("chain_pos", chain_pos), ("chain_parent", chain_parent)):
        # A key not in the batch is a caller's slip (a stale or misspelt key): its link or
        # position would go nowhere, and the chunk it was meant for would be stored without it.
        stray = [k for k in given or {} if k not in items]
        if stray:
            raise InvalidValue(
                f"{name} names {len(stray)} key(s) not in this put: {stray[:3]!r:.200}; it places the batch's own keys"
            )
    for key, pos in (chain_pos or {}).items():
        if type(pos) is not int or not 0 <= pos <= MAX_CHAIN_POS:
            raise InvalidValue(f"chain_pos of {key!r:.80} must be an int in 0..{MAX_CHAIN_POS}, got {pos!r:.80}")
    for key, parent in (chain_parent or {}).items():
        try:
            check_key(parent)
        except InvalidKey as exc:
            raise InvalidKey(f"chain_parent of {key!r:.80}: {exc}") from None
    check_no_loop(chain_parent or {})  # (a loop is out of order too, but said more plainly)
    # Positions grow from parent to child (put_commit.lua holds every stored link to it, which is
    # what keeps chains from looping): checked here within the batch, before anything is reserved.
    positions: Mapping[str, int] = chain_pos or {}
    for key, parent in (chain_parent or {}).items():
        if key not in positions:
            raise InvalidValue(f"{key!r:.80} has a chain_parent but no chain_pos: a chunk is placed after its parent")
        if parent in positions and positions[parent] >= positions[key]:
            raise InvalidValue(
                f"chain_pos of {key!r:.80} is {positions[key]}, not after that of its parent {parent!r:.80}, "
                f"{positions[parent]}: positions grow from parent to child"
            )


def check_no_loop(chain_parent: Mapping[str, str]) -> None:
    """Refuse parent links of one batch that loop (a key its own parent, or a -> b -> a): each
    chunk of a loop counts a stored child, is never a leaf, and could never be evicted. Loops
    through chunks already stored are out of order, which put_commit.lua refuses."""
    done: set[str] = set()  # keys whose walk up the batch's links ended without a loop
    for start in chain_parent:
        path: list[str] = []
        on_path: set[str] = set()
        key: str | None = start
        while key is not None and key not in done:
            if key in on_path:
                loop = path[path.index(key) :]
                raise InvalidValue(
                    f"chain_parent links loop: {' -> '.join(repr(k) for k in [*loop, key])} "
                    f"(a chunk's parent is the one before it); no chunk of a loop could ever be evicted"
                )
            path.append(key)
            on_path.add(key)
            key = chain_parent.get(key)
        done.update(path)


#: Replicas a put may ask for.
MAX_REPLICAS = 16


def check_put_options(replicas: object, preferred_node: object) -> int:
    """A put's options, checked before anything else (an empty batch too: the same call with items
    must not be the first to say they are wrong); returns ``replicas`` as an int."""
    count = as_count(replicas)
    if count is None or not 1 <= count <= MAX_REPLICAS:
        raise InvalidValue(f"replicas must be an int in 1..{MAX_REPLICAS}, got {replicas!r:.80}")
    if preferred_node is not None and not isinstance(preferred_node, str):
        raise InvalidValue(
            "preferred_node must be a node id (str) or None, "
            f"got {type(preferred_node).__name__}: {preferred_node!r:.80}"
        )
    return count
