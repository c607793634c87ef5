"""Checks of the chunk arrays a PrefixCache stores: the chunks of one prompt are alike (one dtype;
every full chunk the same size, a tail no larger). One float64 chunk in a float32 chain made every
later load through it fail, and a half-size chunk half-filled the caller's buffer while the hit
still counted its tokens. And the caller's output buffers for a load, and its reads."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mooncake_store.client.buffers import as_source
from mooncake_store.client.gets import counted_keys, uncounted
from mooncake_store.client.prefix_hash import as_token_array
from mooncake_store.errors import InvalidValue, MooncakeError, NoCapacity
from mooncake_store.policy.placement import check_batch_fits, live_nodes, tier_capacity
from mooncake_store.tiers.gpu_arrays import is_device_array
from mooncake_store.types import NodeInfo, TierKind, footprint_bytes

if TYPE_CHECKING:
    from mooncake_store.client.client import Client


def tail_tokens(token_ids: Any, chunk_tokens: int) -> int:
    """Tokens in the partial last chunk of ``token_ids`` (0: none; None ids, block hashes: none)."""
    return 0 if token_ids is None else len(as_token_array(token_ids)) % chunk_tokens


#: (position, dtype, bytes, shape) of a chunk: what the chunks of one prompt must share.
Layout = tuple[int, str, int, tuple[int, ...]]


def check_chunks_alike(chunks: dict[int, Any], *, tail_index: int | None, stored: Layout | None = None) -> None:
    """The chunks about to be stored, by position: one dtype, full chunks of one size and shape,
    the tail (``tail_index``) no larger. ``stored`` is the layout of a full chunk of the prompt
    stored before, which the new ones extend: they must be like it too (a chunk of another shape
    with as many bytes, another model's KV layout, was restored through the chain as this one's).
    Device arrays are left to the put, which checks them itself."""
    layouts = {}
    for i, value in chunks.items():
        if is_device_array(value):
            continue
        source = as_source(value)
        layouts[i] = (source.dtype, len(source.view), source.shape)
    if stored is not None:
        first, dtype, size, shape = stored
    else:
        # The first full chunk is the reference (the tail alone, when it is all there is).
        first = min((i for i in layouts if i != tail_index), default=tail_index)  # type: ignore[assignment]
        if first is None or first not in layouts:
            return
        dtype, size, shape = layouts[first]
    was = " (stored before)" if stored is not None else ""
    for i, (other_dtype, other_size, other_shape) in sorted(layouts.items()):
        what = "the tail" if i == tail_index else f"chunk {i}"
        if other_dtype != dtype:
            raise InvalidValue(f"{what} has dtype {other_dtype}, but chunk {first}{was} {dtype}: one prompt, one dtype")
        if other_size > size or (other_size != size and i != tail_index):
            raise InvalidValue(f"{what} holds {other_size} B, but chunk {first}{was} {size} B: full chunks are alike")
        if i != tail_index and first != tail_index and tuple(other_shape) != tuple(shape):
            raise InvalidValue(
                f"{what} has shape {tuple(other_shape)}, but chunk {first}{was} {tuple(shape)}: full chunks are alike"
            )


def stored_layout(client: Client, keys: list[str], statuses: list[str], tail_index: int | None) -> Layout | None:
    """(position, dtype, size, shape) of a full chunk of this prompt stored before (claim status HAVE),
    which a store that extends the chain must match: checked within one call only, a float64
    chunk appended to a float32 chain made every load through it fail. One more round trip, and
    only for a store that extends a chain."""
    for i, status in enumerate(statuses):
        if status == "HAVE" and i != tail_index:
            meta = client.object_meta(keys[i])
            if meta is not None:
                return i, meta.dtype, meta.size_bytes, tuple(meta.shape)
            return None  # evicted meanwhile: the new chunks are checked among themselves
    return None


def kept_beside_chain(
    client: Client,
    keys: list[str],
    statuses: list[str],
    values: dict[int, Any],
    chunk_bytes: int,
    *,
    replicas: int,
    preferred_node: str | None,
) -> list[int]:
    """The first of the new chunks (``values``' indices into ``keys``, in chain order; each at most
    ``chunk_bytes``) that the nodes keep beside the stored chain they extend (claim status HAVE
    before them), which stays in their memory while they are written: the store pins the chunk
    each run hangs off, and a chain is cut only from its leaves (a node's disk tier takes what
    of it the disk keeps under its mark, by demotion). Counted as
    room to be made, a prompt longer than the cluster stored again (the next request over the
    same document) waited out the client's timeout for room only its own chain held, failed with
    NoCapacity, and the pass that room request had started then cut its chain back to a few
    chunks. Host chunks only; an index round trip only when the chain and the new chunks together
    are more than the nodes keep under their high watermarks (by their capacities: a node
    table's use is up to a heartbeat old, and the client's a moment older)."""
    mine = sorted(values)
    frozen = [keys[i] for i in range(max(mine, default=0)) if statuses[i] == "HAVE"]
    if len(mine) < 2 or not frozen or any(is_device_array(v) for v in values.values()):
        return mine
    nodes, now_ms = client._node_table(), client._server_now_ms()
    live = live_nodes(nodes.values(), now_ms)

    def disk_kept(node: NodeInfo) -> int:
        return int(node.high_watermark(1.0) * tier_capacity(node, TierKind.DISK))

    kept = sum(int(n.high_watermark(1.0) * tier_capacity(n, TierKind.HOST)) + disk_kept(n) for n in live)
    if (len(frozen) + len(mine) * replicas) * footprint_bytes(chunk_bytes) <= kept:
        return mine  # they fit beside the chain (one copy of it at least) in the nodes' room
    # Per node, the chain's bytes that must stay in its host tier: a disk tier takes, by
    # demotion, as much of the chain as it keeps under its mark (the chain moves; only its leaf
    # is pinned, and a chain is cut from its leaves alone), and the rest stays. Left out where a
    # node had a disk tier, a small one (8 MiB beside 16 MiB of host) had each store again wait
    # out timeout_s, fail with NoCapacity, and the pass it started cut the chain back each time.
    on_node: Counter[str] = Counter()
    for meta in client.index.lookup(frozen, lease_ms=0, counted=False).objects:
        for replica in meta.replicas if meta is not None else ():
            if replica.tier in (TierKind.HOST, TierKind.DISK):
                on_node[replica.node_id] += footprint_bytes(replica.size_bytes)
    by_id = {n.node_id: n for n in live}
    held = {
        node_id: max(0, chain - (disk_kept(by_id[node_id]) if node_id in by_id else 0))
        for node_id, chain in on_node.items()
    }
    try:
        check_batch_fits(
            nodes.values(),
            [chunk_bytes] * len(mine),
            replicas=replicas,
            now_ms=now_ms,
            preferred_node=preferred_node,
            held_bytes=held,
        )
    except NoCapacity as exc:
        if exc.batch_limit is not None:
            return mine[: exc.batch_limit]
    return mine


def is_sequence_or_stack(value: object) -> bool:
    """A sequence of buffers, or an array or tensor of two or more dimensions: a row per chunk, as
    Client.get_many_into takes them (numpy arrays and tensors are no ``Sequence``). One buffer of
    bytes or text is not: a sequence of ints or characters, it was split into one "chunk" each."""
    if isinstance(value, str | bytes | bytearray | memoryview):
        return False
    return isinstance(value, Sequence) or (getattr(value, "ndim", 0) >= 2 and hasattr(value, "__getitem__"))


def output_buffers(outs: object, found: int) -> list[object]:
    """The first ``found`` buffers of ``outs`` (a sequence or a stacked array, or a callable
    outs(n) returning one)."""
    given = outs(found) if callable(outs) else outs
    if not is_sequence_or_stack(given):
        what = "outs(n) returned" if callable(outs) else "outs is"
        raise InvalidValue(
            f"{what} {type(given).__name__}; a sequence of output buffers (or an array of a row each) is wanted"
        )
    return list(given[:found])  # type: ignore[index]


def read_run(client: Client, keys: list[str], dests: list[object] | None) -> list[Any]:
    """A load's matched chunks, into ``dests`` when given (else as new arrays); None from the first
    one that cannot be read on."""
    counted_before = counted_keys()
    try:
        if dests is None:
            return client.get_many(keys)
        client.get_many_into(keys, dests)
        return dests
    except InvalidValue:
        raise  # the caller's buffers are wrong (too small, bad dtype): an error, not a miss
    except MooncakeError as exc:
        # Cut short by a close (the client's or this cache's): that error, not a miss.
        client._raise_if_interrupted(exc)
        # Some chunk went away between match and read (a node died): keep the readable run. The
        # batch's lookup counted these keys, unless it failed before it did (the index unreachable);
        # into device buffers each key is looked up on its own, in order, up to the one that
        # failed: those first ones are counted already (all were taken for uncounted, and counted
        # twice, when the batch stopped short of the last).
        out: list[Any] = []
        counted = min(len(keys), counted_keys() - counted_before)
        for i, key in enumerate(keys):
            with uncounted() if i < counted else contextlib.nullcontext():
                try:
                    if dests is None:
                        out.append(client.get(key))
                    else:
                        client.get_into(key, dests[i])
                        out.append(dests[i])
                except InvalidValue:
                    raise
                except MooncakeError as exc:
                    client._raise_if_interrupted(exc)
                    break
        return out + [None] * (len(keys) - len(out))
