"""The chunk arrays a PrefixCache stores and the buffers it loads into, against the shared real
cluster: chunks alike within a prompt, and buffers for the full chunks only when
another writer stored the tail."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake_store import Client, InvalidValue, PrefixCache

C = 16  # tokens per chunk
ELEMS = 64  # float32 values per full chunk


@pytest.fixture
def cache(shared_client: Client) -> Iterator[PrefixCache]:
    cache = PrefixCache(shared_client, f"chunks-{uuid.uuid4().hex[:8]}/f32/L1/kv1/d8/tp0", chunk_tokens=C)
    yield cache
    cache.close()


def chunk(i: int, elems: int = ELEMS, dtype: str = "<f4") -> np.ndarray:
    return np.full(elems, i + 1, dtype=dtype)


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([chunk(0), chunk(1, dtype="<f8"), chunk(2)], "chunk 1 has dtype <f8, but chunk 0 <f4"),
        ([chunk(0), chunk(1, ELEMS // 2), chunk(2)], "chunk 1 holds 128 B, but chunk 0 256 B"),
        ([chunk(0), chunk(1), chunk(2), chunk(3, ELEMS + 1)], "the tail holds 260 B, but chunk 0 256 B"),
    ],
    ids=["dtype", "short-chunk", "long-tail"],
)
def test_chunks_unlike_the_prompts_others_are_refused(
    cache: PrefixCache, chunks: list[np.ndarray], message: str
) -> None:
    """One float64 chunk in a float32 chain made every load through it fail; a half-size chunk
    half-filled the caller's buffer while the hit still counted its tokens."""
    ids = np.arange(3 * C + 4)
    with pytest.raises(InvalidValue, match=message):
        cache.store(ids, chunks, include_tail=len(chunks) == 4)
    assert cache.match(ids) == 0  # nothing stored


@pytest.mark.parametrize(
    ("extension", "message"),
    [
        (chunk(2, dtype="<f8"), r"chunk 2 has dtype <f8, but chunk 0 \(stored before\) <f4"),
        (chunk(2, ELEMS * 2), r"chunk 2 holds 512 B, but chunk 0 \(stored before\) 256 B"),
    ],
    ids=["dtype", "size"],
)
def test_chunks_that_extend_a_stored_chain_are_like_its_chunks(
    cache: PrefixCache, extension: np.ndarray, message: str
) -> None:
    """The chunks were compared within one store() only: a float64 chunk appended to a stored
    float32 chain was accepted, and every load into float32 buffers through it failed."""
    ids = np.arange(3 * C)
    assert cache.store(ids[: 2 * C], [chunk(0), chunk(1)]) == 2
    with pytest.raises(InvalidValue, match=message):
        cache.store(ids, [chunk(0), chunk(1), extension])
    assert cache.match(ids) == 2 * C  # the stored chain as it was
    assert cache.store(ids, [chunk(0), chunk(1), chunk(2)]) == 1  # a like chunk extends it
    outs = [np.zeros(ELEMS, np.float32) for _ in range(3)]
    with cache.load(ids, outs=outs) as hit:
        assert hit.num_tokens == 3 * C and outs[2].tolist() == [3.0] * ELEMS


def test_a_short_tail_is_stored_and_loaded(cache: PrefixCache) -> None:
    ids = np.arange(2 * C + 4)
    assert cache.store(ids, [chunk(0), chunk(1), chunk(2, 16)], include_tail=True) == 3
    outs = [np.zeros(ELEMS, np.float32), np.zeros(ELEMS, np.float32), np.zeros(ELEMS, np.float32)]
    with cache.load(ids, outs=outs) as hit:
        assert hit.num_tokens == 2 * C + 4 and outs[2][:16].tolist() == [3.0] * 16


def test_buffers_for_the_full_chunks_load_them_when_the_tail_is_stored_too(cache: PrefixCache) -> None:
    """load() takes the tail by default: once any writer had stored the prompt's tail, a caller
    with one buffer per full chunk got "3 chunk(s) matched but 2 output buffer(s) given"."""
    ids = np.arange(2 * C + 4)
    assert cache.store(ids, [chunk(0), chunk(1), chunk(2, 16)], include_tail=True) == 3
    outs = [np.zeros(ELEMS, np.float32), np.zeros(ELEMS, np.float32)]
    with cache.load(ids, outs=outs) as hit:
        assert (hit.num_chunks, hit.num_tokens) == (2, 2 * C)
        assert outs[0].tolist() == [1.0] * ELEMS and outs[1].tolist() == [2.0] * ELEMS
    assert cache.refcounts(ids) == [0, 0, 0]  # the tail was not left pinned
    with pytest.raises(InvalidValue, match=r"3 chunk\(s\) matched but 1 output buffer\(s\) given"):
        cache.load(ids, outs=outs[:1])
