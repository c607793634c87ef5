"""Opening a redis-py client for the index's URL: checked with a PING, and every failure a
ConnectError whose message names the server (password redacted) and what to do."""

from __future__ import annotations

import redis

from mooncake_store.config import redact_url
from mooncake_store.errors import ConnectError

#: What a ConnectError for an unreachable server advises, unless the caller says otherwise.
START_A_CLUSTER = (
    "Start a cluster with `mooncake up` or mooncake_store.LocalCluster, "
    "or point MOONCAKE_REDIS_URL at a running server."
)


def connect_redis(url: str, *, timeout_s: float = 10.0, advice: str = START_A_CLUSTER) -> redis.Redis:
    """A redis-py client for ``url`` that has answered a PING, else :class:`ConnectError`, whose
    message ends with ``advice`` when the server cannot be reached."""
    try:
        client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=min(timeout_s, 5.0),
            health_check_interval=30,
        )
        client.ping()
    except (ValueError, TypeError) as exc:  # TypeError: a URL option redis-py does not know (?foo=1)
        # Redacted: the CLI prints these messages, and a password must not reach terminals or logs.
        raise ConnectError(f"bad Redis URL {redact_url(url)!r}: {exc}") from None
    except redis.AuthenticationError as exc:
        # Reached, and refused: advice to start a cluster would send the user the wrong way.
        raise ConnectError(
            f"Redis at {redact_url(url)} refused the credentials: {str(exc).rstrip('.')} (check the user "
            "and password in the URL, redis://USER:PASSWORD@HOST:PORT/DB, against the server's ACL)"
        ) from None
    except redis.RedisError as exc:
        raise ConnectError(f"cannot reach Redis at {redact_url(url)}: {str(exc).rstrip('.')}. {advice}") from None
    return client
