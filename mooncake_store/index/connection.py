"""Opening a redis-py client for the index's URL: checked with a PING, and every failure a
ConnectError whose message names the server (password redacted) and what to do; and closing a
client's pool for good, under calls racing the close (ClosedPool, close_pool)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any

import redis

from mooncake_store.config import redact_url
from mooncake_store.errors import ConfigError, ConnectError

#: What a ConnectError for an unreachable server advises, unless the caller says otherwise.
START_A_CLUSTER = (
    "Start a cluster with `mooncake up` or mooncake_store.LocalCluster, "
    "or point MOONCAKE_REDIS_URL at a running server."
)
#: How often a server still loading its data is asked again (connect_redis).
LOADING_POLL_S = 0.05


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
        _ping_once_loaded(client, url, timeout_s)
    # TypeError: a URL option redis-py does not know (?foo=1); OverflowError: a timeout of inf
    # (?socket_timeout=inf), which the socket layer refuses only at connect.
    except (ValueError, TypeError, OverflowError) as exc:
        # Redacted: the CLI prints these messages, and a password must not reach terminals or logs.
        raise ConnectError(f"bad Redis URL {redact_url(url)!r}: {exc}") from None
    except redis.AuthenticationError as exc:
        # Reached, and refused: advice to start a cluster would send the user the wrong way.
        raise ConnectError(
            f"Redis at {redact_url(url)} refused the credentials: {str(exc).rstrip('.')} (check the user "
            "and password in the URL, redis://USER:PASSWORD@HOST:PORT/DB, against the server's ACL)"
        ) from None
    except redis.ResponseError as exc:
        # Reached, and it refused the handshake: the URL asks for something it lacks. The advice to
        # start a cluster would send the user the wrong way.
        if "DB index" in str(exc):
            raise ConfigError(
                f"Redis at {redact_url(url)} has no database {client.connection_pool.connection_kwargs.get('db')}: "
                f"{str(exc).rstrip('.')} (its `databases` setting; pick a lower /DB in the URL)"
            ) from None
        raise ConnectError(f"Redis at {redact_url(url)} refused the connection: {str(exc).rstrip('.')}") from None
    except redis.RedisError as exc:
        raise ConnectError(f"cannot reach Redis at {redact_url(url)}: {str(exc).rstrip('.')}. {advice}") from None
    return client


def _ping_once_loaded(client: redis.Redis, url: str, timeout_s: float) -> None:
    """PING; a server that restarted over a persisted index answers LOADING until it has loaded
    it (seconds for millions of keys), so it is asked again within ``timeout_s``: an agent or a
    client started beside it failed with "cannot reach Redis", advised to start a cluster."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.exceptions.BusyLoadingError as exc:
            if time.monotonic() >= deadline:
                raise ConnectError(
                    f"Redis at {redact_url(url)} is still loading its data after {timeout_s:g} s (the "
                    f"timeout; it restarted): {str(exc).rstrip('.')}"
                ) from None
            time.sleep(LOADING_POLL_S)


class ClosedPool(redis.ConnectionPool):
    """The pool of a closed RedisIndex: every command fails at once (redis.ConnectionError, which
    the index's calls turn into ConnectError) and none opens a connection."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self._closed_url = url

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError(f"the index client for {self._closed_url} is closed")

    def release(self, connection: Any) -> None:
        """A connection of the pool this one replaced, handed back by a call that raced the close
        (redis-py hands it to the client's pool of the moment): closed, not kept."""
        connection.disconnect()


class _ClosingList(list):  # type: ignore[type-arg]
    """The idle list of a closed pool: a connection handed back to it is closed, not kept (a call
    that raced the close hands back its connection, whose socket the close shut down, or one it
    opened again to retry)."""

    def append(self, conn: Any) -> None:
        conn.disconnect()


def close_pool(pool: redis.ConnectionPool) -> None:
    """Close a pool's idle connections, and cut those of calls under way (other threads racing a
    close) by shutting their sockets down. Disconnecting those too set their sockets to None under
    the calls using them (redis-py is not made for that): the calls failed with a TypeError or an
    AttributeError from inside redis-py instead of a connection error. A shut-down socket ends
    the call's read or write with one; the socket itself is closed once the call is done with it
    and hands it back (_ClosingList: the old pool kept it open, a descriptor each, until a cyclic
    garbage collection). In a forked child nothing is cut: the
    sockets are the parent's too (redis-py's own disconnect checks the pid as well)."""
    if getattr(pool, "pid", os.getpid()) != os.getpid():
        return
    with pool._lock:  # redis-py's own lock over its two lists
        in_use = list(pool._in_use_connections)
        idle, pool._available_connections = pool._available_connections, _ClosingList()
    for conn in idle:
        conn.disconnect()
    for conn in in_use:
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
