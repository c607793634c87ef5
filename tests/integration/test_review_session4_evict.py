"""Review of victim choice and eviction under memory pressure (policy/eviction.py, victims.lua,
evict.lua, agent/pressure.py, agent/moves.py).

Real Agent objects in this process against the session's real Redis-compatible server, sharing one
namespace where a test needs two. Their background pressure loop is stubbed out and their sync loop
never fires on its own: each test drives the passes itself, which places an interleaving exactly.
Each test fails on the code it was written against, for the reason in its docstring.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from mooncake_store import Client, connect
from mooncake_store.agent import pressure
from mooncake_store.agent.node import Agent
from mooncake_store.agent.pressure import MAX_PASSES, PressureManager
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 256 * KiB


@pytest.fixture
def ns() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_agent(make_inproc_agent: Callable[..., Agent], ns: str) -> Callable[..., Agent]:
    """In-process Agents sharing one namespace; pressure passes and syncs run only when called."""

    def make(**overrides: object) -> Agent:
        settings: dict[str, object] = {
            "node_id": f"rv4e-{uuid.uuid4().hex[:6]}",
            "heartbeat_interval_s": 600.0,
            "heartbeat_ttl_s": 1200.0,
            "reserve_timeout_s": 30.0,
            "spill_to_peers": False,
        }
        settings.update(overrides)

        def prepare(agent: Agent) -> None:
            agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]

        return make_inproc_agent(namespace=ns, prepare=prepare, **settings)

    return make


@pytest.fixture
def open_client(redis_url: str, ns: str) -> Iterator[Callable[..., Client]]:
    clients: list[Client] = []

    def make(**kwargs: object) -> Client:
        client = connect(redis_url, namespace=ns, timeout_s=10, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def chunk(key: str) -> np.ndarray:
    seed = sum(key.encode()) % 251
    return np.full(CHUNK, seed, dtype=np.uint8)


def put_chain(client: Client, keys: list[str], **kwargs: object) -> None:
    client.put_many(
        {k: chunk(k) for k in keys},
        chain_pos={k: i for i, k in enumerate(keys)},
        chain_parent={k: keys[i - 1] for i, k in enumerate(keys) if i > 0},
        **kwargs,  # type: ignore[arg-type]
    )


def drain_host(agent: Agent) -> None:
    """What PressureManager.run does for the host tier after a wake."""
    for _ in range(MAX_PASSES):
        if agent.pressure.relieve_host() == 0:
            break


# ---------------------------------------------------------------------------------------------
def test_a_pass_does_not_evict_hotter_chain_leaves_while_a_colder_chain_still_has_leaves(
    make_agent: Callable[..., Agent], open_client: Callable[..., Client]
) -> None:
    """Whole node full, nowhere to move: the coldest chain leaves go first. _walk ranks one sample
    and walks it in order; after evicting the cold chain's last chunk it meets that chain's next
    chunk with the sample's stale ``children`` (1), skips it, and goes on to the *hotter* chains'
    leaves. Three chains of five 256 KiB chunks (15 of 16 slots; high 90 %, low 75 %: three chunks
    must go): the coldest chain should lose its last three chunks, and the two hotter chains stay
    whole. On this code each chain loses its last chunk, hottest included."""
    agent = make_agent(host_bytes=4 * MiB)
    client = open_client()
    chains = {c: [f"{c}/{i}" for i in range(5)] for c in ("cold", "warm", "hot")}
    for keys in chains.values():
        put_chain(client, keys, preferred_node=agent.node_id)
        time.sleep(0.01)  # distinct last-access times: cold < warm < hot
    agent.sync_once()
    used, _, _, _ = agent.table.usage()
    assert used > agent.config.high_watermark * agent.table.capacity_bytes
    drain_host(agent)
    present = {c: [client.exists(k) for k in keys] for c, keys in chains.items()}
    assert present["warm"] == [True] * 5 and present["hot"] == [True] * 5, (
        f"hotter chains lost chunks while the cold chain still had leaves to give: {present}"
    )
    assert present["cold"] == [True, True, False, False, False], present


# ---------------------------------------------------------------------------------------------
def test_a_replicated_chain_parent_is_not_stuck_on_a_full_node(
    make_agent: Callable[..., Agent], open_client: Callable[..., Client]
) -> None:
    """A chunk with stored children may not lose its *last* replica (evict.lua answers PARENT),
    but one of two replicas may go: the chain stays prefix-closed through the other. Pressure's
    _demote_or_evict refuses any eviction of a victim with children > 0, whatever
    ``other_nodes`` says, and spilling to the node that holds the other replica is refused too.
    So a node whose tier holds the second replicas of chain parents (their children live on the
    other node only, e.g. this node evicted its replicas of the leaves earlier) stays past its
    high watermark forever: no pass moves a byte."""
    a = make_agent(host_bytes=4 * MiB)
    b = make_agent(host_bytes=32 * MiB)
    client = open_client()
    parents = [f"p{i}" for i in range(15)]  # 15 of a's 16 slots: past its high watermark (90 %)
    for p in parents:
        client.put_many({p: chunk(p)}, chain_pos={p: 0}, replicas=2)
        client.put_many(
            {p + "/c": chunk(p + "/c")}, chain_pos={p + "/c": 1}, chain_parent={p + "/c": p}, preferred_node=b.node_id
        )
    a.sync_once()
    b.sync_once()
    for p in parents:
        meta = client.object_meta(p)
        assert meta is not None and {r.node_id for r in meta.replicas} == {a.node_id, b.node_id}
    used, _, _, _ = a.table.usage()
    capacity = a.table.capacity_bytes
    assert used > a.config.high_watermark * capacity
    drain_host(a)
    used_after, _, _, _ = a.table.usage()
    assert used_after <= a.config.low_watermark * capacity, (
        f"a stays at {used_after}/{capacity} B: every victim is a chain parent whose other replica "
        "on b would keep its chain whole, yet none is evicted"
    )
    for p in parents:  # every chain still matches in full, through b
        assert client.exists(p) and client.exists(p + "/c")


# ---------------------------------------------------------------------------------------------
def test_eviction_refuses_an_object_read_after_the_sample_was_taken(
    make_agent: Callable[..., Agent], open_client: Callable[..., Client]
) -> None:
    """DESIGN.md §3.3: an agent never evicts a replica whose read lease is live. The pass ranks a
    sample taken at its start; a reader that looks an object up after that (a hot object now) gets
    a lease, and evict.lua still drops the object's last replica: it checks pins but not the
    lease (swap_replica may move a leased object, the graveyard keeps its bytes; an eviction
    removes the object, so the next read of a hot object misses). The agent's own evict call with
    the victim it sampled must be refused."""
    agent = make_agent(host_bytes=4 * MiB)
    client = open_client(lease_ms=60_000)
    client.put("obj", chunk("obj"), preferred_node=agent.node_id)
    agent.sync_once()
    (victim,) = [c for c in agent.index.victim_candidates(agent.node_id, "host") if c.key == "obj"]
    assert victim.lease_until_ms <= agent.index.server_time_ms()  # cold when sampled
    assert np.array_equal(client.get("obj"), chunk("obj"))  # read now: a live lease
    (evicted,) = agent.pressure.moves.evict_many([victim], TierKind.HOST)
    assert not evicted and client.exists("obj"), "an object under a live read lease was evicted"


# ---------------------------------------------------------------------------------------------
def test_the_pressure_loop_begins_no_pass_once_the_agent_stops(
    make_agent: Callable[..., Agent], open_client: Callable[..., Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agent.stop() sets the stop event, waits 5 s for its threads, then closes the spiller, the
    arena and the index connection. The pressure loop ran up to MAX_PASSES passes per tier (and
    the repair pass) after the event was set, so a stop during a long drain tore those down under
    a running pass. Here a drain needs ~6 passes of 32 victims (200 objects of 16 KiB in a 4 MiB
    arena, watermarks 0.5/0.1, nowhere to move: evicted); the stop event is set as the first pass
    ends, and the loop must return without beginning a second one."""
    monkeypatch.setattr(pressure, "SAMPLE", 32)
    agent = make_agent(host_bytes=4 * MiB, high_watermark=0.5, low_watermark=0.1)
    client = open_client()
    keys = [f"s{i:03d}" for i in range(200)]
    client.put_many(
        {k: np.full(16 * KiB, i % 251, dtype=np.uint8) for i, k in enumerate(keys)}, preferred_node=agent.node_id
    )
    agent.sync_once()
    stop = threading.Event()
    walks: list[int] = []
    real_walk = agent.pressure._walk

    def walk_then_stop(*args: Any, **kwargs: Any) -> int:
        moved = real_walk(*args, **kwargs)
        walks.append(moved)
        stop.set()  # what Agent.stop() does while a pass runs
        return moved

    agent.pressure._walk = walk_then_stop  # type: ignore[method-assign]
    agent.pressure.wake()
    loop = threading.Thread(target=PressureManager.run, args=(agent.pressure, stop), daemon=True)
    loop.start()
    loop.join(timeout=30)
    assert not loop.is_alive(), "the pressure loop did not return after the stop event"
    assert len(walks) == 1 and 0 < walks[0] <= 32 * 16 * KiB, (
        f"passes after the stop event: {len(walks) - 1} (moved per pass: {walks})"
    )
    assert sum(client.exists(k) for k in keys) >= 200 - 32
