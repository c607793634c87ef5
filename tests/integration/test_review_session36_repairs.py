"""A repair copy whose copy_replicas answer was lost (the call and its replay) after the index
added the copies (review, thirty-sixth session): the copies landed, the peer committed them, and
the source never counted them in copies_out, while a spill's lost answer is counted once the
index names the target (LocalMoves.resolve). Repairs now hand such copies to the same resolve.

Real in-process agents on the session's real Redis; the source's index connection goes through
RedisProxy, which loses the replies after the server ran the script."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from redis_proxy import RedisProxy
from test_repair_across_tiers import reap, replicas
from test_review_session8_pressure import counter, sha

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.errors import MooncakeError
from mooncake_store.types import TierKind

MiB = 1 << 20


def test_a_repair_copy_whose_answer_was_lost_is_counted_once_the_index_names_it(
    proxied_agent: Callable[..., Agent],
    direct_agent: Callable[..., Agent],
    client_of: Callable[[str], Client],
    proxy: RedisProxy,
    namespace: str,
) -> None:
    source = proxied_agent(namespace, host_bytes=16 * MiB)
    dying = direct_agent(namespace, host_bytes=16 * MiB)
    client = client_of(namespace)
    values = {f"rl/{i}": np.random.default_rng(i).integers(0, 255, 128 << 10, dtype=np.uint8) for i in range(4)}
    client.put_many(values, replicas=2, preferred_node=source.node_id)
    target = direct_agent(namespace, host_bytes=16 * MiB)
    reap(source, dying)
    rule = proxy.drop_reply(sha(source, "copy_replicas"), times=2)
    with pytest.raises(MooncakeError):
        source.pressure.repairs.run_once(set())  # the pressure loop logs this and goes on
    assert rule.hits == 2, "the injected fault did not fire"
    target.sync_once()  # the ack list, not the expired reservations, decides: it keeps the copies
    on_target = [k for k in values if any(r.node_id == target.node_id for r in replicas(source, k))]
    assert sorted(on_target) == sorted(values), on_target
    for key, value in values.items():
        assert np.array_equal(client.get(key), value), key
    assert source.pressure.repairs.run_once(set()) == 0  # whole again: nothing left to copy
    assert counter(source, TierKind.HOST, "copies_out") == len(values), (
        f"copies_out={counter(source, TierKind.HOST, 'copies_out')} after {len(values)} copies landed "
        "whose copy_replicas answer was lost"
    )
    assert source.pressure.moves.settle() == 0
    assert counter(source, TierKind.HOST, "copies_out") == len(values), "counted twice"
