-- evict: drop one replica of an object under memory pressure (this is a cache).
-- KEYS: none
-- ARGV: [1] prefix, [2] key, [3] node, [4] alloc id
-- Returns: "OK" (the replica is in its agent's graveyard; if it was the last one the object is
-- gone and counted in stats.evictions), "GONE" (no such replica any more), "PINNED", "LEASED" (a
-- reader looked it up since the sample that chose it: it is hot, and a read lease is live), or
-- "PARENT" (its last replica, and stored chunks of its prefix chain hang off it: the sample that
-- chose it was stale).
local key, node, alloc = ARGV[2], ARGV[3], ARGV[4]
local ok = P .. 'o:' .. key
local f = redis.call('HMGET', ok, 'replicas', 'lease_until')
if not f[1] then return 'GONE' end
local now = now_ms()
local keep, found = {}, false
for _, r in ipairs(decode_list(f[1])) do
  if r[1] == node and r[5] == alloc then found = true else table.insert(keep, r) end
end
if not found then return 'GONE' end
if live_pins(key, now) > 0 then return 'PINNED' end
-- The last readable copy: none left on a live node (a replica on a node past its deadline is
-- skipped by readers and soon reaped, so it keeps neither the chain whole nor the object).
local readable = 0
for _, r in ipairs(keep) do
  if r[6] == 'COMPLETE' and node_live(r[1], now) then readable = readable + 1 end
end
if readable == 0 and children_of(key) > 0 then return 'PARENT' end
if tonumber(f[2] or 0) > now then return 'LEASED' end
redis.call('ZADD', P .. 'gc:' .. node, math.max(now, tonumber(f[2] or 0)), alloc)
local still_there = false
for _, r in ipairs(keep) do if r[1] == node then still_there = true end end
if not still_there then redis.call('SREM', P .. 'nobj:' .. node, key) end
if #keep == 0 then
  drop_object(key)
  redis.call('HINCRBY', P .. 'stats', 'evictions', 1)
else
  redis.call('HSET', ok, 'replicas', encode_list(keep))
  -- What is left is on dead nodes only: the object is lost to readers now, which is an eviction.
  if readable == 0 then redis.call('HINCRBY', P .. 'stats', 'evictions', 1) end
end
return 'OK'
