"""Loads the Lua scripts, each with the shared prelude in front, as redis-py Script objects
(EVALSHA, reloaded transparently after a server restart or SCRIPT FLUSH).

Every script runs at most once per call: RedisIndex._run retries a call whose connection broke,
and the reply of the first run may be what was lost. A call that names a key (KEYS[1], a random
token per call) finds the first run's reply stored under it and gets that back instead of running
again. Replayed, agent_sync would drop the acks the lost reply carried (the agent then frees
committed objects), evict would answer GONE for what it evicted, put_commit EXPIRED for a put it
made and remove GONE for a key it removed. Scripts whose replay is harmless run without a key
(RedisIndex.REPLAY_SAFE), which spares their calls the stored reply.
"""

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
    "evict_chains",
    "drop_corrupt",
    "copy_replicas",
    "repair_candidates",
)


def _read(name: str) -> str:
    return resources.files("mooncake_store.index").joinpath("lua", f"{name}.lua").read_text()


#: How long the reply of a call made with a token is kept for its retry: a retry follows the
#: broken connection at once, on a fresh one.
ONCE_TTL_MS = 10_000

# The script's own text becomes a function, so that its top-level returns end that function; a
# call with a token returns the stored reply of its first run (cmsgpack keeps integers exact).
_ONCE_HEAD = "local function script_body()\n"
_ONCE_TAIL = f"""
end
if #KEYS == 1 then
  local done = redis.call('GET', KEYS[1])
  if done then return cmsgpack.unpack(done) end
  local reply = script_body()
  -- pcall: a server at maxmemory refuses this write when the body wrote nothing (a remove of
  -- absent keys), and the body's answer stands all the same; only a retry would run it again.
  redis.pcall('SET', KEYS[1], cmsgpack.pack(reply), 'PX', {ONCE_TTL_MS})
  return reply
end
return script_body()
"""


def build_script(client: redis.Redis, *parts: str) -> redis.commands.core.Script:
    """A script of ``parts`` (preludes, then the script itself), runnable at most once per token."""
    *preludes, body = parts
    return client.register_script("\n".join(preludes) + "\n" + _ONCE_HEAD + body + _ONCE_TAIL)


def load_scripts(client: redis.Redis) -> dict[str, redis.commands.core.Script]:
    prelude = _read("prelude")
    return {name: build_script(client, prelude, _read(name)) for name in SCRIPT_NAMES}


#: Public name for the script reader, for modules that load their own scripts (index/prefix.py).
read_script = _read
