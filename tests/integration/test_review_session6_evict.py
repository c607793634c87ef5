"""Review of batched evictions (commit 711f7c3): a pressure pass queues its evictions during the
walk, counts them as moved, and sends them to the index in one evict.lua call at its end.

Real in-process Agents against the session's real Redis-compatible server. Their background
pressure loop is stubbed out and their sync loop never fires on its own: each test drives the
passes itself (as PressureManager.run does after a wake), which places an interleaving exactly.
The only fault injected is a reader: a wrapper around the agent's victim sample that, right after
the sample is taken, looks an object up as any client would (a read lease), i.e. a read that lands
while the pass is under way.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.agent.pressure import MAX_PASSES
from mooncake_store.index.schema import BATCH_LIMIT
from mooncake_store.types import TierKind

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 256 * KiB


@pytest.fixture
def make_agent(make_peer_agent: Callable[..., Agent]) -> Callable[..., Agent]:
    """In-process Agents sharing one namespace, no spills; pressure passes and syncs run only when called."""
    return functools.partial(make_peer_agent, spill_to_peers=False)


def chunk(key: str) -> np.ndarray:
    return np.full(CHUNK, sum(key.encode()) % 251, dtype=np.uint8)


def put_chain(client: Client, keys: list[str], node: str) -> None:
    client.put_many(
        {k: chunk(k) for k in keys},
        chain_pos={k: i for i, k in enumerate(keys)},
        chain_parent={k: keys[i - 1] for i, k in enumerate(keys) if i > 0},
        preferred_node=node,
    )


def cold_chain_then_warmer(client: Client, agent: Agent, chain: list[str], others: list[str]) -> None:
    """A 5-chunk chain put first (the coldest), then loose objects, all on ``agent``, synced."""
    put_chain(client, chain, agent.node_id)
    time.sleep(0.01)  # the loose objects are strictly warmer
    for k in others:
        client.put(k, chunk(k), preferred_node=agent.node_id)
    agent.sync_once()


def drain_host(agent: Agent) -> None:
    """What PressureManager.run does for the host tier after a wake."""
    for _ in range(MAX_PASSES):
        if agent.pressure.relieve_host() == 0:
            break


def read_after_sample(agent: Agent, reads: list[list[str]], lease_ms: int) -> list[int]:
    """Fault injection: the n-th victim sample of the host tier is followed at once by a reader
    looking up ``reads[n]`` (a read lease, as any get takes). Returns the per-call log."""
    calls: list[int] = []
    sample = agent.index.victim_candidates

    def sampled_then_read(node_id: str, tier: str, **kwargs: Any) -> Any:
        out = sample(node_id, tier, **kwargs)
        if tier == "host":
            n = len(calls)
            calls.append(n)
            if n < len(reads) and reads[n]:
                agent.index.lookup(reads[n], lease_ms=lease_ms)
        return out

    agent.index.victim_candidates = sampled_then_read  # type: ignore[method-assign]
    return calls


def used(agent: Agent) -> int:
    return agent.table.usage()[0]


# ---------------------------------------------------------------------------------------------
def test_a_read_chain_leaf_does_not_make_a_pass_with_movable_victims_move_nothing(
    make_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """DEFECT. 15 of 16 slots (high 90 %, low 75 %: 3 chunks must go). The coldest objects are a
    five-chunk chain; ten independent warmer chunks follow. A reader reads the chain's leaf right
    after the pass took its sample. Before the batch, the leaf's eviction was refused (LEASED), did
    not count, its parent stayed a non-leaf, and the walk went on to the warm objects: 3 chunks
    left in one pass. Now the walk queues the leaf and, optimistically, its two ancestors, counts
    all three as moved and stops; at the end the leaf is LEASED and both ancestors PARENT: the pass
    returns 0 although 10 movable objects were in its sample, ends the drain and arms the
    fruitless back-off, and the tier stays past its high watermark."""
    agent = make_agent(host_bytes=4 * MiB)
    client = clients(agent, timeout_s=10)
    chain = [f"cold/{i}" for i in range(5)]
    warm = [f"warm{i}" for i in range(10)]
    cold_chain_then_warmer(client, agent, chain, warm)
    capacity = agent.table.capacity_bytes
    assert used(agent) > agent.config.high_watermark * capacity
    read_after_sample(agent, [[chain[-1]]], lease_ms=60_000)
    moved = agent.pressure.relieve_host()
    assert moved >= 3 * CHUNK, (
        f"the pass moved {moved} B: its queued chain (leaf read after the sample) failed at the end, "
        f"and the ten movable warm objects of its sample were never tried"
    )
    drain_host(agent)
    assert used(agent) <= agent.config.low_watermark * capacity
    assert all(client.exists(k) for k in chain), "a chain lost a chunk"


def test_a_drain_is_not_ended_while_movable_objects_remain(
    make_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """DEFECT (the consequence: a drain that stops early for good). 15 of 16 slots: one cold
    loose chunk, then chain A (5), chain B (5), four warm chunks. A reader reads a chain's leaf
    right after each of the first two samples. Pass 1 queues the loose chunk and A's leaf and its
    parent (3 chunks = need): only the loose chunk goes, 14 of 16 slots, under the high watermark
    but past the low one. Pass 2 queues B's leaf and parent (2 = need): both refused, the pass
    returns 0, and _walk drops the tier from the draining set. From then on no pass moves anything
    (need is 0 below the high watermark without a drain), even after the leases ran out: the tier
    stays past its low watermark with nine movable chunks there. Before the batch, pass 1 skipped
    the refused leaf, skipped its ancestors and evicted B's leaf and parent instead: 12 of 16."""
    agent = make_agent(host_bytes=4 * MiB)
    client = clients(agent, timeout_s=10)
    client.put("loose", chunk("loose"), preferred_node=agent.node_id)
    time.sleep(0.01)
    a = [f"A/{i}" for i in range(5)]
    put_chain(client, a, agent.node_id)
    time.sleep(0.01)
    b = [f"B/{i}" for i in range(5)]
    put_chain(client, b, agent.node_id)
    time.sleep(0.01)
    for i in range(4):
        client.put(f"warm{i}", chunk(f"warm{i}"), preferred_node=agent.node_id)
    agent.sync_once()
    capacity = agent.table.capacity_bytes
    low = agent.config.low_watermark * capacity
    assert used(agent) > agent.config.high_watermark * capacity
    # Leases that outlast the first drain on a loaded machine: one that ran out before a pass's
    # batched evict call would not refuse its leaf (LEASED), and the test would pass without its
    # case. Both are checked: a leaf was refused, and the drain ended while every lease lived.
    lease_ms = 3000
    read_after_sample(agent, [[a[-1]], [b[-1]]], lease_ms=lease_ms)
    statuses: list[list[str]] = []
    evict_many = agent.index.evict_many

    def evict_many_seen(*args: Any, **kwargs: Any) -> list[str]:
        out = evict_many(*args, **kwargs)
        statuses.append(list(out))
        return out

    agent.index.evict_many = evict_many_seen  # type: ignore[method-assign]
    started = time.monotonic()  # before the reads, which the drain's samples make
    drain_host(agent)
    took = time.monotonic() - started
    assert any("LEASED" in call for call in statuses), f"no read leaf was refused in the first drain: {statuses}"
    assert took < lease_ms / 1000, f"the first drain took {took:.1f} s: a reader's lease may have run out in it"
    time.sleep(lease_ms / 1000 + 0.5)  # the readers' leases have run out: everything is movable
    drain_host(agent)  # the next pressure tick
    assert used(agent) <= low, (
        f"the tier stays at {used(agent)}/{capacity} B, past its low watermark ({int(low)} B), "
        "with no pass under way: the drain ended on a pass whose queued evictions were all refused"
    )
    for chain in (a, b):  # prefix-closed: what is left of a chain is its head
        present = [client.exists(k) for k in chain]
        assert present == sorted(present, reverse=True), present


# ---------------------------------------------------------------------------------------------
# Regression tests (pass on 711f7c3): what the batch must keep.
def test_a_failed_leaf_keeps_its_optimistically_freed_parent_and_counts_stay_exact(
    make_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """Chain safety and statistics with a refusal inside the batch: whatever the walk's optimistic
    children_gone said, a parent whose child is still there is not evicted (PARENT), the per-tier
    'evictions' counter and the index's stats count only what went, and every object left is whole
    and its chain prefix-closed."""
    agent = make_agent(host_bytes=4 * MiB)
    client = clients(agent, timeout_s=10)
    chain = [f"c/{i}" for i in range(5)]
    loose = [f"l{i}" for i in range(10)]
    cold_chain_then_warmer(client, agent, chain, loose)
    stats_before = int(agent.index.redis.hget(agent.index.prefix + "stats", "evictions") or 0)
    read_after_sample(agent, [[chain[-1]]], lease_ms=60_000)
    drain_host(agent)
    present = {k: client.exists(k) for k in chain + loose}
    gone = [k for k, there in present.items() if not there]
    assert all(present[k] for k in chain), f"chain chunks evicted under a read leaf: {present}"
    counted = agent.pressure.counters[TierKind.HOST]["evictions"]
    stats_after = int(agent.index.redis.hget(agent.index.prefix + "stats", "evictions") or 0)
    assert counted == len(gone) == stats_after - stats_before, (counted, gone, stats_after - stats_before)
    for k in chain + loose:
        if present[k]:
            assert np.array_equal(client.get(k), chunk(k))


def test_evict_many_keeps_order_across_batch_limit_chunks_and_odd_keys(
    make_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """RedisIndex.evict_many splits at BATCH_LIMIT: a leaf at the end of one call lets its parent,
    the first entry of the next call, go; a parent before its leaf is refused; keys with spaces,
    quotes, braces, commas, '%' and non-ASCII text are matched exactly; one status per entry."""
    agent = make_agent(host_bytes=4 * MiB)
    client = clients(agent, timeout_s=10)
    odd = ['a b "c" {d}', "e,f%g", "ключ/ü", "x]\\y"]
    small = np.zeros(1024, np.uint8)
    client.put_many({"p": small}, chain_pos={"p": 0}, preferred_node=agent.node_id)
    client.put_many({"c": small}, chain_pos={"c": 1}, chain_parent={"c": "p"}, preferred_node=agent.node_id)
    client.put_many({"q": small}, chain_pos={"q": 0}, preferred_node=agent.node_id)
    client.put_many({"d": small}, chain_pos={"d": 1}, chain_parent={"d": "q"}, preferred_node=agent.node_id)
    for k in odd:
        client.put(k, small, preferred_node=agent.node_id)
    ids = {k: client.object_meta(k).replicas[0].alloc_id for k in ["p", "c", "q", "d", *odd]}  # type: ignore[union-attr]
    filler = [(f"none{i}", 1) for i in range(BATCH_LIMIT - 1)]
    batch = [*filler, ("c", ids["c"]), ("p", ids["p"]), ("q", ids["q"]), ("d", ids["d"])]
    batch += [(k, ids[k]) for k in odd] + [(odd[0], ids[odd[0]])]
    out = agent.index.evict_many(batch, node_id=agent.node_id)
    assert len(out) == len(batch)
    assert out[: BATCH_LIMIT - 1] == ["GONE"] * (BATCH_LIMIT - 1)
    assert out[BATCH_LIMIT - 1 :] == ["OK", "OK", "PARENT", "OK", "OK", "OK", "OK", "OK", "GONE"]
    assert [k for k in ["p", "c", "q", "d", *odd] if client.exists(k)] == ["q"]


def test_a_replicated_parent_goes_here_but_its_last_replica_is_refused_in_the_same_batch(
    make_agent: Callable[..., Agent], clients: Callable[..., Client]
) -> None:
    """Multi-replica objects: a parent with a readable copy on another node may lose this node's
    copy while its child stays; the other node's batch, which would take the last copy, is refused
    (PARENT) while the child is there, and goes once the child went earlier in that batch."""
    a = make_agent(host_bytes=8 * MiB)
    b = make_agent(host_bytes=8 * MiB)
    client = clients(a, timeout_s=10)
    client.put_many({"p": chunk("p")}, chain_pos={"p": 0}, replicas=2)
    client.put_many({"c": chunk("c")}, chain_pos={"c": 1}, chain_parent={"c": "p"}, preferred_node=b.node_id)
    reps = {r.node_id: r.alloc_id for r in client.object_meta("p").replicas}  # type: ignore[union-attr]
    assert set(reps) == {a.node_id, b.node_id}
    c_id = client.object_meta("c").replicas[0].alloc_id  # type: ignore[union-attr]
    assert a.index.evict_many([("p", reps[a.node_id])], node_id=a.node_id) == ["OK"]
    assert b.index.evict_many([("p", reps[b.node_id]), ("c", c_id)], node_id=b.node_id) == ["PARENT", "OK"]
    assert client.exists("p") and not client.exists("c")
    assert b.index.evict_many([("p", reps[b.node_id])], node_id=b.node_id) == ["OK"]
    assert not client.exists("p")
