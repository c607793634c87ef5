"""`short` in stat(), the objects listed for re-replication (thirty-seventh session): a replica
dropped as damaged at the node whose repair list held its object left it listed there, as well as
at the holder listed now, and `short` counted the object twice until that node's next repair call."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mooncake_store import Client
from mooncake_store.agent.node import Agent


def test_a_damaged_replica_at_the_listed_holder_leaves_the_object_counted_short_once(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    agents = [direct_agent(namespace) for _ in range(4)]
    client = client_of(namespace)
    r, p = client.index.redis, client.index.prefix
    client.put("k", np.arange(4096, dtype=np.uint8), replicas=3)
    (meta,) = client.index.lookup(["k"], lease_ms=0).objects
    assert meta is not None
    holding = [rep.node_id for rep in meta.replicas]
    gone = next(a for a in agents if a.node_id == holding[0])
    gone.stop()  # leaves: its purge lists the object, one replica short, at one holder
    (holder,) = [n for n in holding[1:] if r.sismember(p + "repair:" + n, "k")]
    assert client.stat().short == 1
    alloc_id = next(rep.alloc_id for rep in meta.replicas if rep.node_id == holder)
    assert client.index.drop_corrupt("k", alloc_id, node_id=holder)
    (left,) = [n for n in holding[1:] if n != holder]
    assert r.sismember(p + "repair:" + left, "k")  # listed at the holder left
    assert client.stat().short == 1, {n: r.smembers(p + "repair:" + n) for n in holding}
