"""Loads the Lua scripts, each with the shared prelude in front, as redis-py Script objects
(EVALSHA, reloaded transparently after a server restart or SCRIPT FLUSH)."""

from __future__ import annotations

from importlib import resources

import redis

SCRIPT_NAMES = (
    "put_start",
    "put_commit",
    "put_revoke",
    "lookup",
    "remove",
    "node_register",
    "node_heartbeat",
    "node_deregister",
    "node_reap",
    "agent_sync",
    "victims",
    "move_replica",
    "move_replicas",
    "evict",
)


def _read(name: str) -> str:
    return resources.files("mooncake_store.index").joinpath("lua", f"{name}.lua").read_text()


def load_scripts(client: redis.Redis) -> dict[str, redis.commands.core.Script]:
    prelude = _read("prelude")
    return {name: client.register_script(prelude + "\n" + _read(name)) for name in SCRIPT_NAMES}


#: Public name for the script reader, for modules that load their own scripts (index/prefix.py).
read_script = _read
