"""The pressure loop's duties fail one at a time (review, thirty-third session): a relieve pass
that raised at every turn skipped the passes and the repairs after it, so objects a dead node left
short of copies were not copied again for as long as it failed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from helpers import wait_until

from mooncake_store.agent.node import Agent
from mooncake_store.errors import MooncakeError


@pytest.mark.parametrize("failure", [MooncakeError("the index refused the sample (injected)"), KeyError("bug")])
def test_a_pass_that_fails_at_every_turn_does_not_starve_the_repairs(
    make_inproc_agent: Callable[..., Agent], failure: Exception
) -> None:
    calls: Counter[str] = Counter()

    def prepare(agent: Agent) -> None:
        pressure = agent.pressure

        def failing_host_pass() -> int:
            calls["host"] += 1
            raise failure

        real_disk, real_repairs = pressure.relieve_disk, pressure.repairs.run_once

        def disk_pass() -> int:
            calls["disk"] += 1
            return real_disk()

        def repairs(silent: set[str]) -> None:
            calls["repairs"] += 1
            real_repairs(silent)

        pressure.relieve_host = failing_host_pass  # type: ignore[method-assign]
        pressure.relieve_disk = disk_pass  # type: ignore[method-assign]
        pressure.repairs.run_once = repairs  # type: ignore[method-assign]

    make_inproc_agent(prepare=prepare, pressure_interval_s=0.05)
    assert wait_until(lambda: calls["repairs"] >= 2 and calls["disk"] >= 2 and calls["host"] >= 2, 10), calls
