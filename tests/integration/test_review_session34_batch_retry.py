"""A batch put whose commit stored some keys and found the others' reservations expired retries only
those others: it wrote the stored ones again, over what another writer had put there meanwhile."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from mooncake_store import Client, LocalCluster, ObjectPinned, PrefixCache


def test_the_retry_of_a_partly_committed_batch_leaves_the_stored_keys_alone(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    cluster = make_cluster(1)
    writer, other = make_client(cluster), make_client(cluster)
    index = writer.index
    real_commit = index.put_commit
    commits: list[list[str]] = []

    def commit_with_b_expired(put_ids: Sequence[str], **kwargs: Any) -> list[str]:
        commits.append(list(put_ids))
        if len(commits) == 1:
            # b's reservation runs out before the commit (its pending record revoked, as an
            # agent's reclaim does): a is stored, b answers EXPIRED.
            index.put_revoke([put_ids[1]])
            statuses = real_commit(put_ids, **kwargs)
            assert statuses[0] == "OK" and statuses[1] != "OK", statuses
            other.put("a", np.full(8, 9, np.uint8))  # another writer replaces a before the retry
            return statuses
        return real_commit(put_ids, **kwargs)

    index.put_commit = commit_with_b_expired  # type: ignore[method-assign]
    writer.put_many({"a": np.full(8, 1, np.uint8), "b": np.full(8, 2, np.uint8)})
    assert len(commits) == 2 and len(commits[1]) == 1  # the retry wrote b alone
    assert np.array_equal(writer.get("a"), np.full(8, 9, np.uint8))  # the other writer's a stands
    assert np.array_equal(writer.get("b"), np.full(8, 2, np.uint8))


def test_a_later_attempt_s_error_still_names_what_the_first_stored(
    make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client]
) -> None:
    """The retry writes only the keys that failed, so its own error (the other key pinned by then)
    named only what it stored itself: done=[] and "stored the other 0 key(s)", with a stored."""
    cluster = make_cluster(1)
    writer = make_client(cluster)
    cache = PrefixCache(make_client(cluster), "batch-retry/f32/L1/kv1/d8/tp0", chunk_tokens=4)
    tokens = list(range(4))
    cache.store(tokens, [np.zeros(16, np.float32)])
    (chunk_key,) = cache.keys(tokens)
    index = writer.index
    real_commit = index.put_commit
    hits: list[Any] = []

    def commit_with_the_chunk_expired_then_pinned(put_ids: Sequence[str], **kwargs: Any) -> list[str]:
        if not hits:
            index.put_revoke([put_ids[1]])  # the chunk key's reservation runs out: EXPIRED
            statuses = real_commit(put_ids, **kwargs)
            hits.append(cache.load(tokens))  # and the chunk is pinned before the retry
            return statuses
        return real_commit(put_ids, **kwargs)

    index.put_commit = commit_with_the_chunk_expired_then_pinned  # type: ignore[method-assign]
    try:
        with pytest.raises(ObjectPinned, match=r"stored the other 1 key\(s\): \['a'\]") as caught:
            writer.put_many({"a": np.full(8, 1, np.uint8), chunk_key: np.full(8, 2, np.uint8)})
        assert caught.value.done == ["a"] and caught.value.pinned == [chunk_key]
        assert np.array_equal(writer.get("a"), np.full(8, 1, np.uint8))
    finally:
        for hit in hits:
            hit.release()
        cache.close()
