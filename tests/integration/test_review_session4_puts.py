"""Review of the put path against a full node (session 4): placement, waiting, NoCapacity.

Real agents in the test process (make_inproc_agent, sharing one namespace so that they see each
other and spill to each other), the session's real Redis/Valkey, and the real Client over shm/TCP.
Nothing of the component under review is stubbed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from mooncake_store import Client, NoCapacity, connect
from mooncake_store.agent.node import Agent
from mooncake_store.transport import frames

MiB = 1 << 20
UNIT = 64  # the host allocator's alignment


def value_for(key: str, size: int) -> np.ndarray:
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little") % (2**32)
    return np.random.default_rng(seed).integers(0, 255, size, dtype=np.uint8)


def pin(client: Client, key: str, ttl_ms: int = 120_000) -> None:
    """A pin as the prefix cache takes one: an entry with an expiry in the object's pins zset."""
    now_ms = client.index.server_time_ms()
    client.index.redis.zadd(client.index.prefix + "pins:" + key, {"test-pin": now_ms + ttl_ms})


@pytest.fixture
def clients(redis_url: str) -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(namespace: str, **options: object) -> Client:
        client = connect(redis_url, namespace=namespace, **options)  # type: ignore[arg-type]
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def two_agents(make_inproc_agent: Callable[..., Agent], a_bytes: int, b_bytes: int) -> tuple[str, Agent, Agent]:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    common = {"namespace": ns, "sync_interval_s": 0.2, "reserve_timeout_s": 30.0, "spill_to_peers": True}
    a = make_inproc_agent(node_id=f"a-{uuid.uuid4().hex[:4]}", host_bytes=a_bytes, **common)
    b = make_inproc_agent(node_id=f"b-{uuid.uuid4().hex[:4]}", host_bytes=b_bytes, **common)
    return ns, a, b


def test_a_put_to_a_full_node_is_not_starved_by_a_long_read_lease_on_a_removed_object(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """Node a holds ten cold 1 MiB objects and a 4 MiB object that a reader (lease_ms=60 s) has
    just read, after which it is removed: its 4 MiB wait in a's graveyard for 60 s. A 4 MiB put
    pinned to a is refused (2 MiB free); a's pressure pass counts the graveyard's 4 MiB as "returning
    by itself" (pressure.py relieve_host/_relieve subtract _returning from the waiting reservation),
    so it moves nothing, and the writer's put fails with NoCapacity after its timeout_s, although
    the cold objects could spill to b, which is empty."""
    ns, a, _b = two_agents(make_inproc_agent, 16 * MiB, 64 * MiB)
    writer = clients(ns, timeout_s=4.0, lease_ms=300)
    reader = clients(ns, lease_ms=60_000)
    cold = [f"cold/{i}" for i in range(10)]
    for key in cold:
        writer.put(key, value_for(key, MiB), preferred_node=a.node_id)
    writer.put("big", value_for("big", 4 * MiB), preferred_node=a.node_id)  # 14 MiB used: under 90%
    assert np.array_equal(reader.get("big"), value_for("big", 4 * MiB))  # a 60 s lease on its bytes
    assert writer.remove("big")
    time.sleep(0.5)  # the writer's own short leases on the cold objects are over

    writer.put("new", value_for("new", 4 * MiB), preferred_node=a.node_id)

    assert np.array_equal(writer.get("new"), value_for("new", 4 * MiB))
    for key in cold:
        assert np.array_equal(writer.get(key), value_for(key, MiB)), key


def test_a_batch_over_max_batch_refused_half_way_leaks_no_reservation(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """TcpTransport.reserve sends a batch in RESERVE frames of at most MAX_BATCH entries. When the
    first frame is granted and the second refused, the NoCapacity leaves the first frame's
    reservations behind: they are in no plan, so abandon() never frees them, and they hold the
    node's space until reserve_timeout_s (30 s). Here a holds one cold object of 8191 units and
    8193 free; the batch needs 8194 units (8192 of 64 B, then one of 128 B). The refusal makes a
    spill the cold object to b, after which the batch fits, but every retry finds 8192 units still
    held by the leaked frame and the put_many fails with NoCapacity."""
    ns, a, _b = two_agents(make_inproc_agent, 16384 * UNIT, 64 * MiB)
    writer = clients(ns, timeout_s=5.0, lease_ms=300)
    writer.put("cold", value_for("cold", 8191 * UNIT), preferred_node=a.node_id)
    time.sleep(0.5)
    batch: dict[str, object] = {f"s/{i:05d}": value_for(f"s/{i:05d}", UNIT) for i in range(frames.MAX_BATCH)}
    batch["s/tail"] = value_for("s/tail", 2 * UNIT)
    assert len(batch) == frames.MAX_BATCH + 1

    writer.put_many(batch, preferred_node=a.node_id)

    for key in ("s/00000", "s/04096", f"s/{frames.MAX_BATCH - 1:05d}", "s/tail"):
        assert np.array_equal(writer.get(key), batch[key]), key
    assert np.array_equal(writer.get("cold"), value_for("cold", 8191 * UNIT))


def test_no_capacity_after_waiting_on_a_full_preferred_node_names_its_free_space_and_capacity(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """A put pinned to a node full of pinned objects waits timeout_s, then fails: rightly. But the
    error it ends with is _reserve_elsewhere's "no node could take 2097152 B for key 'x'
    (replicas=1): node a-.. is full": the agent's own answer, with the node's free bytes, largest
    free block and capacity (TcpTransport.reserve), is dropped in Reserver.reserve, so the message
    names the value but not the limit (DESIGN.md §3.6, §6)."""
    ns, a, _b = two_agents(make_inproc_agent, 4 * MiB, 16 * MiB)
    writer = clients(ns, timeout_s=1.0, lease_ms=300)
    writer.put("pinned", value_for("pinned", 3 * MiB), preferred_node=a.node_id)
    pin(writer, "pinned")

    with pytest.raises(NoCapacity) as info:
        writer.put("x", value_for("x", 2 * MiB), preferred_node=a.node_id)

    message = str(info.value)
    assert str(2 * MiB) in message, message
    assert str(4 * MiB) in message, message  # the limit: a's capacity (and what of it is free)


def test_replicas_2_with_a_preferred_node_is_not_refused_for_want_of_nodes_with_room(
    make_inproc_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """Two live nodes, both nearly empty. put(replicas=2, preferred_node=a) fails at once with a
    permanent NoCapacity "replicas=2 needs 2 live nodes with room; only 1 qualify (a-..)":
    rank_nodes drops every node but the preferred one, then choose_replica_nodes blames room. The
    preferred node should take the first replica and placement choose the second; at the very
    least the error must not claim that b has no room."""
    ns, a, b = two_agents(make_inproc_agent, 16 * MiB, 16 * MiB)
    writer = clients(ns, timeout_s=4.0)
    value = value_for("both", MiB)

    writer.put("both", value, replicas=2, preferred_node=a.node_id)

    meta = writer.object_meta("both")
    assert meta is not None
    assert sorted(r.node_id for r in meta.replicas) == sorted([a.node_id, b.node_id])
    assert np.array_equal(writer.get("both"), value)
