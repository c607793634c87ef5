"""A PrefixCache inherited by a forked child: the child's copy lists the parent's held hits, and
its close() (a ``with`` block ending) unpinned them in the index through fresh connections, waited
for the parent's puts and cancelled the parent's transfers; a child's hit.release() unpinned the
parent's hit too. In a child both now only mark their copy released or closed."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import in_forked_child

from mooncake_store import Client, LocalCluster, PrefixCache
from mooncake_store.errors import ObjectPinned


@pytest.mark.parametrize("how", ["close", "release"])
def test_a_forked_childs_release_or_close_keeps_the_parents_pins(
    cluster: LocalCluster, client: Client, how: str
) -> None:
    cache = PrefixCache(client, "fork-pins", chunk_tokens=4)
    tokens = list(range(12))
    assert cache.store(tokens, [np.full(64, i, dtype=np.uint8) for i in range(3)]) == 3
    hit = cache.load(tokens)  # held by the parent: its 3 chunks pinned
    try:
        assert hit.num_chunks == 3 and cache.refcounts(tokens) == [1, 1, 1]

        def child() -> str:
            if how == "release":
                hit.release()
                return f"released {hit.released}"
            cache.close()
            return "closed"

        said = in_forked_child(child)
        assert said == ("released True" if how == "release" else "closed")
        # The parent still holds its hit: its chunks stay pinned, and cannot be removed.
        assert cache.refcounts(tokens) == [1, 1, 1], f"after the child's {how}"
        with pytest.raises(ObjectPinned):
            client.remove(hit.keys[0])
        assert not hit.released
        # The parent's cache goes on working.
        with cache.load(tokens) as again:
            assert again.num_chunks == 3
    finally:
        hit.release()
        cache.close()
    assert cache.refcounts(tokens) == [0, 0, 0]
