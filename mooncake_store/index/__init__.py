"""The global index in Redis/Valkey: schema, Lua scripts and the client that runs them.

Knows no transport and no tier implementation (DESIGN.md §5): it stores and returns locations.
"""

from mooncake_store.index.client import RedisIndex
from mooncake_store.index.connection import connect_redis

__all__ = ["RedisIndex", "connect_redis"]
