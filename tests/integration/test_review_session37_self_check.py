"""The look at an advertised address (agent start, `mooncake doctor`) on an endpoint that accepts
and never answers (thirty-seventh session): after the PING's wait had used the whole timeout, the
probe for a Redis server there got the whole timeout again, so such an endpoint cost each agent
start and doctor check twice its timeout."""

from __future__ import annotations

import pytest
from helpers import SilentPeer

from mooncake_store.agent import self_check


def test_a_silent_endpoint_leaves_the_resp_probe_only_what_the_budget_has_left(
    silent_peer: SilentPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    given: list[float] = []
    probe = self_check.speaks_resp

    def spy(endpoint: str, *, timeout_s: float) -> bool:
        given.append(timeout_s)
        return probe(endpoint, timeout_s=timeout_s)

    monkeypatch.setattr(self_check, "speaks_resp", spy)
    astray = self_check.who_answers(silent_peer.endpoint, "any-arena", timeout_s=1.0)
    assert astray is not None and not astray.answered and "does not answer" in str(astray), astray
    # The PING waited out the 1 s; what the RESP probe may wait is a floor (0.25 s), not another second.
    assert len(given) == 1 and given[0] <= 0.5, given
