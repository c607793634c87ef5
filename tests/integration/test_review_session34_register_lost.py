"""An agent whose record vanished (an index restarted empty: here its namespace's keys are deleted,
which is what the agent sees) holds what it had until its registration says for how long. When
that registration ran but its reply was lost (dropped 3 s late, past the retry window: a
ConnectError), the next beat found the record there and the hold never ended: every object's memory
stayed allocated for good, though the index named none of it."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import redis
from helpers import wait_until
from redis_proxy import RedisProxy

from mooncake_store import Client
from mooncake_store.agent.node import Agent
from mooncake_store.index.client import VANISHED_HOLD_MS


def test_memory_is_freed_after_a_lost_registration_reply(
    proxied_agent: Callable[..., Agent], proxy: RedisProxy, client_of: Callable[[str], Client], redis_url: str
) -> None:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    agent = proxied_agent(namespace, heartbeat_interval_s=0.3, heartbeat_ttl_s=3.0, sync_interval_s=0.2)
    client = client_of(namespace)
    client.put("big", b"x" * (1 << 20))
    assert wait_until(lambda: agent.table.usage()[3] == 1, 10), "the commit never reached the agent's table"
    proxy.drop_reply(str(agent.index._scripts["node_register"].sha), delay_s=3.0)
    raw = redis.Redis.from_url(redis_url)
    try:  # the index loses everything of this namespace, as a server restarted empty would
        raw.delete(*raw.scan_iter(match=f"mc:{{{namespace}}}:*", count=1000))
    finally:
        raw.close()
    assert wait_until(lambda: agent.node_id in client.index.nodes(), 15)  # registered, its reply lost
    assert client.exists("big") is False
    # Held for readers under leases the index lost (VANISHED_HOLD_MS), then freed.
    assert wait_until(lambda: agent.table.usage()[0] == 0, VANISHED_HOLD_MS / 1000 + 15), agent.table.usage()
