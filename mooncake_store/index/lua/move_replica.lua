-- move_replica: compare-and-swap one replica's location (DESIGN.md §3.4: copy, swap, then free).
-- KEYS: none
-- ARGV: [1] prefix, [2] key, [3] old node, [4] old alloc id, [5] new replica JSON
--       [node, tier, offset, size, alloc_id, state]
-- Returns: "OK" the object now lists the new location and the old one is in its agent's graveyard
--   (freed once the object's read leases have run out); "GONE" the object no longer holds the old
--   location (removed, replaced or moved meanwhile: drop the new copy); "PINNED" the object has
--   live pins and must not move (drop the new copy).
-- The new location's agent is told through its ack list, exactly as for a commit.
local key, old_node, old_alloc = ARGV[2], ARGV[3], ARGV[4]
local ok = P .. 'o:' .. key
local f = redis.call('HMGET', ok, 'replicas', 'lease_until')
if not f[1] then return 'GONE' end
local now = now_ms()
local reps = decode_list(f[1])
local new = cjson.decode(ARGV[5])
local found = nil
for i, r in ipairs(reps) do
  if r[1] == old_node and r[5] == old_alloc and r[6] == 'COMPLETE' then found = i end
  -- Already swapped: this is a retry of a call whose reply was lost. Answer as the first call did,
  -- or the caller would free a copy the index names.
  if r[1] == new[1] and r[5] == new[5] then return 'OK' end
end
if not found then return 'GONE' end
if live_pins(key, now) > 0 then return 'PINNED' end
new[6] = 'COMPLETE'
local old = reps[found]
reps[found] = new
redis.call('HSET', ok, 'replicas', encode_list(reps))
redis.call('ZADD', P .. 'gc:' .. old_node, math.max(now, tonumber(f[2] or 0)), old_alloc)
local still_there = false
for _, r in ipairs(reps) do if r[1] == old_node then still_there = true end end
if not still_there then redis.call('SREM', P .. 'nobj:' .. old_node, key) end
redis.call('SADD', P .. 'nobj:' .. new[1], key)
redis.call('RPUSH', P .. 'acks:' .. new[1], new[5])
return 'OK'
