"""Checks of the chunk arrays a PrefixCache stores: the chunks of one prompt are alike (one dtype;
every full chunk the same size, a tail no larger). One float64 chunk in a float32 chain made every
later load through it fail, and a half-size chunk half-filled the caller's buffer while the hit
still counted its tokens."""

from __future__ import annotations

from typing import Any

from mooncake_store.client.buffers import as_source
from mooncake_store.client.prefix_hash import as_token_array
from mooncake_store.errors import InvalidValue
from mooncake_store.tiers.gpu_arrays import is_device_array


def tail_tokens(token_ids: Any, chunk_tokens: int) -> int:
    """Tokens in the partial last chunk of ``token_ids`` (0: none; None ids, block hashes: none)."""
    return 0 if token_ids is None else len(as_token_array(token_ids)) % chunk_tokens


def check_chunks_alike(chunks: dict[int, Any], *, tail_index: int | None) -> None:
    """The chunks about to be stored, by position: one dtype, full chunks of one size, the tail
    (``tail_index``) no larger. Device arrays are left to the put, which checks them itself."""
    layouts = {}
    for i, value in chunks.items():
        if is_device_array(value):
            continue
        source = as_source(value)
        layouts[i] = (source.dtype, len(source.view))
    # The first full chunk is the reference (the tail alone, when it is all there is).
    first = min((i for i in layouts if i != tail_index), default=tail_index)
    if first is None or first not in layouts:
        return
    dtype, size = layouts[first]
    for i, (other_dtype, other_size) in sorted(layouts.items()):
        what = "the tail" if i == tail_index else f"chunk {i}"
        if other_dtype != dtype:
            raise InvalidValue(f"{what} has dtype {other_dtype}, but chunk {first} {dtype}: one prompt, one dtype")
        if other_size > size or (other_size != size and i != tail_index):
            raise InvalidValue(f"{what} holds {other_size} B, but chunk {first} {size} B: full chunks are alike")
