"""An index address that answers what is no Redis reply (another service took the port after the
server went, a proxy's fault): the SDK's call fails with a MooncakeError that says so, and the next
call, on a fresh connection, works. A bare redis.exceptions.InvalidResponse escaped every
MooncakeError handler (RedisIndex._run caught only the redis-py errors it knew)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np
import pytest
from redis_proxy import RedisProxy

from mooncake_store import Client, connect
from mooncake_store.agent.node import Agent
from mooncake_store.errors import ProtocolError


def test_a_reply_that_is_no_redis_protocol_is_a_protocol_error_and_the_next_call_works(
    proxy: RedisProxy, direct_agent: Callable[..., Agent], client_of: Callable[[str], Client]
) -> None:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    direct_agent(namespace)
    value = np.arange(4096, dtype=np.uint8)
    client_of(namespace).put("k", value)
    with connect(proxy.url, namespace=namespace, timeout_s=10.0) as reader:
        assert np.array_equal(reader.get("k"), value)  # through the proxy, as it is
        rule = proxy.garble_reply(str(reader.index._scripts["lookup"].sha))
        with pytest.raises(ProtocolError, match=r"index script lookup: .* answered what is no Redis reply"):
            reader.get("k")
        assert rule.hits == 1
        assert np.array_equal(reader.get("k"), value)  # a fresh connection, a whole reply
