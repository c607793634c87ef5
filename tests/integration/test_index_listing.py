"""Listing keys and reading the counts, as `mooncake ls` and `stat()` do, against the session's real
Redis and a real cluster: the listing is the first keys in key order (it was any ``limit`` of them,
sorted), and a Redis error on the way is a MooncakeError (it escaped as redis-py's own)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from mooncake_store import Client, LocalCluster, connect
from mooncake_store.errors import ConnectError, MooncakeError
from mooncake_store.index.listing import first_in_order


def test_first_in_order_keeps_the_smallest_distinct_names() -> None:
    names = [f"k{i:03d}" for i in range(300)]
    shuffled = [names[i] for i in np.random.default_rng(3).permutation(300)]
    with_repeats = shuffled[:50] + shuffled + shuffled[:50]  # a SCAN may yield a name twice
    assert sorted(first_in_order(with_repeats, 3)) == ["k000", "k001", "k002"]
    assert sorted(first_in_order(with_repeats, 1000)) == names
    assert first_in_order([], 5) == []


def test_a_listing_is_the_first_keys_in_key_order(shared_client: Client) -> None:
    prefix = f"lim-{uuid.uuid4().hex[:8]}/"
    keys = [f"{prefix}{i:03d}" for i in range(300)]
    shared_client.put_many({key: b"v" for key in reversed(keys)})
    try:
        assert [x.key for x in shared_client.index.list_keys(prefix + "*", limit=3)] == keys[:3]
        assert [x.key for x in shared_client.index.list_keys(prefix + "*")] == keys
    finally:
        shared_client.remove_many(keys)


@pytest.fixture
def denied_counts(shared_cluster: LocalCluster) -> Iterator[Client]:
    """A client whose Redis user may run everything but SCARD and SSCAN."""
    admin = redis.Redis.from_url(shared_cluster.redis_url)
    user = f"mc-{uuid.uuid4().hex[:8]}"
    admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-scard", "-sscan"])
    client = connect(f"redis://{user}:pw@{shared_cluster.redis_url.split('://', 1)[1]}")
    try:
        yield client
    finally:
        client.close()
        admin.acl_deluser(user)
        admin.close()


def test_a_redis_error_while_listing_or_counting_is_a_mooncake_error(denied_counts: Client) -> None:
    """A refusal is no connection error (the CLI would say "cannot connect", exit 4)."""
    with pytest.raises(MooncakeError, match=r"refused reading the counts: .*no permissions to run the .scard.") as info:
        denied_counts.stat()
    assert not isinstance(info.value, ConnectError)
    with pytest.raises(MooncakeError, match=r"refused listing the keys: .*no permissions to run the .sscan.") as info:
        denied_counts.index.list_keys()
    assert not isinstance(info.value, ConnectError)
