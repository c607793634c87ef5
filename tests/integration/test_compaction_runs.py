"""A compaction run's own steps (agent/compaction.py), found by a compaction probe (2026-12-07):
the order it moves a window's objects in, the objects it moved already, the graves it frees, a
batch it made blocks for, and a stop in the middle of it. Layouts in units of 64 KiB; objects that
a live read lease keeps in place stand for whatever may not move."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from helpers import assert_all_read_back, wait_until

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.types import EvictionCandidate, TierKind

KiB = 1 << 10
U = 64 * KiB


def _lay_out(client: Client, agent: Agent, layout: list[tuple[str, int]], holes: set[str]) -> dict[str, np.ndarray]:
    """Put ``layout`` (key, units) in address order on ``agent``, then remove the keys in
    ``holes``: what is left, by key. Keys starting with X are leased for a minute (unmovable)."""
    values = {key: np.full(units * U, i + 1, np.uint8) for i, (key, units) in enumerate(layout)}
    for key, value in values.items():
        client.put(key, value, preferred_node=agent.node_id)
    for key in holes:
        client.remove(key)
        del values[key]
    agent.sync_once()
    assert (
        [client.object_meta(key).replicas[0].offset // U for key in values]
        == [  # type: ignore[union-attr]
            sum(units for _, units in layout[:i]) for i, (key, _) in enumerate(layout) if key not in holes
        ]
    )
    client.index.lookup([key for key in values if key.startswith("X")], lease_ms=60_000)
    return values


def _free_units(agent: Agent) -> list[int]:
    return sorted(size // U for _, size in agent.table._allocator.free_blocks())


def test_a_window_is_emptied_largest_object_first_as_its_fit_was_checked(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """[A2][B2][C3][.1][X1][.4][X1][.3][X46]: the window [0, 8) fits with C in the 3-hole, B in the
    4-hole and A beside it. Moved in address order, A took the 3-hole (best fit), B the 4-hole, and
    C found holes of 1 and 2: two objects moved for nothing, no block."""
    agent = direct_agent(namespace, host_bytes=64 * U)
    client = client_of(namespace)
    layout = [("A", 2), ("B", 2), ("C", 3), ("h0", 1), ("X1", 1), ("h1", 4), ("X2", 1), ("h2", 3), ("X3", 46)]
    values = _lay_out(client, agent, layout, {"h0", "h1", "h2"})
    compactor = agent.pressure.compactor
    compactor.want_blocks([8 * U])
    assert compactor.run_once() == 3
    assert agent.table.room()[1] == 8 * U
    assert agent.pressure.counters[TierKind.HOST]["compacted"] == 3
    assert_all_read_back(client, values)


def test_a_later_window_of_the_run_is_not_chosen_over_an_object_it_moved(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """[.1][A1][B1][C1][X1][.1][X1][.1][X1][.1][X54], two blocks of 2 wanted: [hole, A], then [B, C].
    A's old block stays allocated until the run frees the graves at its end; counted movable, the
    second window started on it, its copy found A gone, and the run stopped at one block."""
    agent = direct_agent(namespace, host_bytes=64 * U)
    client = client_of(namespace)
    layout = [("h0", 1), ("A", 1), ("B", 1), ("C", 1), ("X1", 1), ("h1", 1), ("X2", 1), ("h2", 1), ("X3", 1)]
    values = _lay_out(client, agent, [*layout, ("h3", 1), ("X4", 54)], {"h0", "h1", "h2", "h3"})
    compactor = agent.pressure.compactor
    relocate = compactor.moves.relocate
    answers: list[bool] = []

    def noted(victim: EvictionCandidate, offset: int) -> bool:
        answers.append(relocate(victim, offset))
        return answers[-1]

    compactor.moves.relocate = noted  # type: ignore[method-assign]
    compactor.want_blocks([2 * U, 2 * U])
    assert compactor.run_once() == 3
    assert answers == [True, True, True]
    assert _free_units(agent) == [4]  # the two blocks, side by side: A, B and C in the holes
    assert_all_read_back(client, values)


def test_a_window_of_more_objects_than_one_sync_frees_is_one_block_when_let_go(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """4096 objects of 512 B, every other one removed, a block of 1 MiB wanted: 1024 objects move.
    One forced sync frees 1000 graves at most: the holds went with 24 old blocks still allocated,
    and the run's block was not one."""
    agent = direct_agent(namespace, host_bytes=2 << 20)
    client = client_of(namespace)
    keys = [f"s{i}" for i in range(4096)]
    for first in range(0, len(keys), 512):
        client.put_many({key: np.full(512, int(key[1:]) % 251, np.uint8) for key in keys[first : first + 512]})
    client.remove_many(keys[0::2])
    for _ in range(3):
        agent.sync_once()
    assert agent.table.room() == (1 << 20, 512)
    compactor = agent.pressure.compactor
    compactor.want_blocks([1 << 20])
    assert compactor.run_once() == 1024
    assert agent.table.room() == (1 << 20, 1 << 20)
    for i in range(1, len(keys), 98):
        assert np.array_equal(client.get(keys[i]), np.full(512, i % 251, np.uint8)), keys[i]


def test_a_stop_ends_a_run_after_the_move_under_way(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """A run went on moving objects after the agent was told to stop (its stop waits 5 s for the
    pressure thread, then closes the arena under it)."""
    agent = direct_agent(namespace, host_bytes=64 * U)
    client = client_of(namespace)
    layout = [("A", 1), ("h0", 1), ("B", 1), ("h1", 1), ("C", 1), ("h2", 1), ("D", 1), ("h3", 1), ("X", 56)]
    values = _lay_out(client, agent, layout, {"h0", "h1", "h2", "h3"})
    stop = threading.Event()
    compactor = agent.pressure.compactor
    relocate = compactor.moves.relocate

    def then_stop(victim: EvictionCandidate, offset: int) -> bool:
        stop.set()  # the agent is told to stop during the first move
        return relocate(victim, offset)

    compactor.moves.relocate = then_stop  # type: ignore[method-assign]
    free_before = agent.table.room()[0]
    compactor.want_blocks([4 * U])  # [A . B .]: A and B to move
    assert compactor.run_once(stop) == 1
    assert agent.table.room()[0] == free_before  # the moved one's old block freed, the holds let go
    assert agent.pressure.counters[TierKind.HOST]["compacted"] == 1
    assert_all_read_back(client, values)


def test_a_batch_whose_blocks_a_compaction_made_evicts_nothing(
    make_inproc_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """A put_many of three ~512 KiB objects to a node whose 2 MiB free is in 256 KiB holes: the
    agent's loop compacted three blocks, then its pass, which checked the batch's sum against the
    largest free block (512 KiB), evicted 1 MiB of objects all the same."""
    agent = make_inproc_agent(
        namespace=namespace,
        node_id="n-batch",
        host_bytes=4 << 20,
        sync_interval_s=0.2,
        heartbeat_interval_s=0.5,
        reserve_timeout_s=30.0,
        high_watermark=1.0,
        low_watermark=0.99,
        prefault=False,
    )
    client = client_of(namespace)
    values = {f"fill{i}": np.full(256 * KiB, i, np.uint8) for i in range(16)}
    for key, value in values.items():
        client.put(key, value)
    client.remove_many(list(values)[::2])
    values = {key: value for i, (key, value) in enumerate(values.items()) if i % 2}
    deadline = time.monotonic() + 10.0
    while agent.table.room() != (2 << 20, 256 * KiB) and time.monotonic() < deadline:
        time.sleep(0.05)  # the graves of the removed ones, freed by the agent's sync
    assert agent.table.room() == (2 << 20, 256 * KiB)
    big = {f"big{i}": np.full(512 * KiB - 64 * i, 200 + i, np.uint8) for i in range(3)}
    client.put_many(big)
    assert_all_read_back(client, {**values, **big})
    host = agent.pressure.counters[TierKind.HOST]
    assert host["compacted"] >= 3
    assert host["evictions"] == 0


def test_a_window_waits_for_a_moved_objects_lease_and_no_pass_evicts_meanwhile(
    direct_agent: Callable[..., Agent], client_of: Callable[[str], Client], namespace: str
) -> None:
    """[A1][.1][X1][.1][X1][C1][X1] then holes and Xs by turns: the one window of 2 is A and a hole,
    A under a read lease of 1.5 s. A moves, its old block waits in the graveyard for the lease, and
    the window is held until then (review, 2026-12-07): its held piece counted as used, and a pass
    for the writer waiting for that block evicted C, a cold object, for room already on its way."""
    agent = direct_agent(namespace, host_bytes=64 * U)
    client = client_of(namespace)
    layout = [("A", 1), ("h0", 1), ("X0", 1), ("h1", 1), ("X1", 1), ("C", 1), ("X2", 1)]
    layout += [(f"{kind}{i}", 1) for i in range(28) for kind in ("hx", "X-")] + [("X-end", 1)]
    holes = {key for key, _ in layout if key.startswith("h")}
    values = _lay_out(client, agent, layout, holes)
    client.index.lookup(["A"], lease_ms=1500)
    compactor = agent.pressure.compactor
    compactor.want_blocks([2 * U])
    assert compactor.run_once() == 1
    assert compactor.held_bytes() == U and agent.table.room()[1] == U  # held until A's old block goes
    agent.pressure.want_room([2 * U])
    assert agent.pressure.relieve_host() == 0
    assert agent.pressure.counters[TierKind.HOST]["evictions"] == 0
    assert wait_until(lambda: not compactor.settle(), 10.0)
    assert agent.table.room()[1] == 2 * U and compactor.held_bytes() == 0
    assert_all_read_back(client, values)
