"""When the pressure loop runs. Past its high watermark every granted reservation wakes the loop;
right after a pass that found nothing movable (everything pinned), the wakes within a short retry
(FRUITLESS_RETRY_S) are one pass at its end: a writer filling such a node costs the index one
victim sample per retry, not one per put. Those wakes used to be dropped, so pins released just
after a fruitless pass moved nothing until the next interval (0.2 s by default: a benchmark's
spill burst started 200 ms late). A reservation that does not fit is never held back.

In-process agents with their real pressure loop (an interval far longer than any wait here, so
only wakes run passes) on the session's real Valkey; the victim samples are counted on the
agent's own index client."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import put_on, wait_until

from mooncake_store.agent import drains as drains_module
from mooncake_store.agent.node import Agent
from mooncake_store.types import TierKind

MiB = 1 << 20


@pytest.fixture
def pinned_agent(make_inproc_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    """full_of_pinned_objects, one fruitless pass just made."""
    agent = full_of_pinned_objects(make_inproc_agent, monkeypatch)
    samples = count_samples(agent)
    agent.pressure.wake()
    # Its first pass ended, and moved nothing: the retry runs.
    assert wait_until(lambda: samples[0] >= 1 and agent.pressure.drains.fruitless_until > 0, 10.0), "no fruitless pass"
    yield agent


def full_of_pinned_objects(make_inproc_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch) -> Agent:
    """4 MiB, high watermark 50 %, three pinned 1 MiB objects; a retry of 3 s after a fruitless pass."""
    monkeypatch.setattr(drains_module, "FRUITLESS_RETRY_S", 3.0)
    agent = make_inproc_agent(host_bytes=4 * MiB, high_watermark=0.5, low_watermark=0.25, pressure_interval_s=600.0)
    now_ms = agent.index.server_time_ms()
    for i in range(3):
        key = f"pinned/{i}"
        agent.index.redis.zadd(agent.index.prefix + "pins:" + key, {"test": now_ms + 600_000})
        put_on(agent, key, np.full(MiB, i, np.uint8), tier=TierKind.HOST)
    return agent


def count_samples(agent: Agent, times: list[float] | None = None) -> list[int]:
    """The agent's victim samples, counted in [0]; their time.monotonic() appended to ``times``."""
    samples = [0]
    sample = agent.index.victim_candidates

    def counted(*args: object, **kwargs: object) -> object:
        samples[0] += 1
        if times is not None:
            times.append(time.monotonic())
        return sample(*args, **kwargs)  # type: ignore[arg-type]

    agent.index.victim_candidates = counted  # type: ignore[method-assign]
    return samples


def test_wakes_after_a_fruitless_pass_are_one_pass_at_the_retry_s_end(pinned_agent: Agent) -> None:
    agent = pinned_agent
    samples = count_samples(agent)
    for _ in range(50):  # a writer's granted reservations, all within the retry
        agent.pressure.wake()
    assert samples[0] == 0  # held until the retry ends (3 s)
    assert wait_until(lambda: samples[0] >= 1, 10.0), "the wakes within the retry were dropped"
    assert samples[0] == 1, samples  # fifty wakes, one pass


def test_pins_released_right_after_a_fruitless_pass_move_at_the_retry_s_end(pinned_agent: Agent) -> None:
    agent = pinned_agent
    index = agent.index
    index.redis.delete(*(index.prefix + f"pins:pinned/{i}" for i in range(3)))
    agent.pressure.wake()  # the release's reservation; the interval is 600 s away
    capacity = agent.table.capacity_bytes
    assert wait_until(lambda: agent.table.usage()[0] <= 0.5 * capacity, 15.0), agent.table.usage()


def test_a_reservation_that_does_not_fit_is_never_held_back(pinned_agent: Agent) -> None:
    agent = pinned_agent
    times: list[float] = []
    samples = count_samples(agent, times)
    retry_ends = agent.pressure.drains.fruitless_until
    agent.pressure.want_room([MiB])
    # Judged against the retry's own end, not a wall-clock wait a loaded machine may overrun.
    assert wait_until(lambda: samples[0] >= 1, 10.0), "want_room was dropped"
    assert times[0] < retry_ends, "want_room waited out the retry (3 s)"


def test_a_reservation_refused_during_a_fruitless_pass_is_not_held_back(
    make_inproc_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass that was running when a RESERVE was refused moved nothing, and its end armed the
    retry over the refusal's wake (reviewer): the refused writer waited it out. Here the refusal
    comes from inside the pass's own victim sample."""
    agent = full_of_pinned_objects(make_inproc_agent, monkeypatch)
    times: list[float] = []
    samples = count_samples(agent, times)
    sample = agent.index.victim_candidates
    refused = [False]

    def refusal_during_the_pass(*args: object, **kwargs: object) -> object:
        if not refused[0]:
            refused[0] = True
            agent.pressure.want_room([MiB])
        return sample(*args, **kwargs)  # type: ignore[arg-type]

    agent.index.victim_candidates = refusal_during_the_pass  # type: ignore[method-assign]
    agent.pressure.wake()
    assert wait_until(lambda: samples[0] >= 2, 10.0), f"{samples[0]} pass(es): the refusal was dropped"
    assert times[1] - times[0] < drains_module.FRUITLESS_RETRY_S, "the refusal waited out the retry (3 s)"
