-- Prefix-cache prelude, prepended (after prelude.lua) to the prefix_* scripts by index/prefix.py.
-- Pins: mc:{ns}:pins:<key> is a zset pin id -> expiry ms; the refcount field of the object record
-- mirrors its live pins as of the last pin/unpin (the zset is what remove/put_commit consult).
-- Claims: mc:{ns}:claim:<key> is a string (writer id, PX ttl) held while one writer stores a
-- missing chunk, so that concurrent requests over one prefix store it once.
-- True when the object has a COMPLETE replica on a live node: the rule of lookup.lua. The common
-- case, one replica, is read without decoding the JSON (half the cost of a chain walk).
local OBJ = P .. 'o:'
local function readable(key, now)
  local reps = redis.call('HGET', OBJ .. key, 'replicas')
  if not reps then return false end
  if string.sub(reps, -13) == ',"COMPLETE"]]' and not string.find(reps, '],[', 1, true) then
    local node = string.match(reps, '^%[%["([^"\\]*)"')
    if node then return node_live(node, now) end
  end
  for _, r in ipairs(record_replicas(key, reps)) do
    if r[6] == 'COMPLETE' and node_live(r[1], now) then return true end
  end
  return false
end
local function pin_key(key, pin_id, until_ms, now)
  local pk = P .. 'pins:' .. key
  -- A pins key of another type holds no pin of this build (live_pins counts none): replaced.
  if redis.call('TYPE', pk).ok ~= 'zset' then redis.call('DEL', pk) end
  redis.call('ZADD', pk, until_ms, pin_id)
  redis.call('HSET', P .. 'o:' .. key, 'refcount', live_pins(key, now))
end
-- Drop pin_id's pin of key; 1 if it held one (expired or not), else 0. The refcount then mirrors
-- the live pins left; the pins of a key whose object is gone go with it.
local function unpin_key(key, pin_id, now)
  local removed = redis.pcall('ZREM', P .. 'pins:' .. key, pin_id)
  if removed == 1 then  -- an error (a pins key of another type) held no pin of this build
    if redis.call('EXISTS', P .. 'o:' .. key) == 1 then
      redis.call('HSET', P .. 'o:' .. key, 'refcount', live_pins(key, now))
    else
      redis.call('DEL', P .. 'pins:' .. key)
    end
  end
  return removed
end
