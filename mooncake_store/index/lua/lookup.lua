-- lookup: find readable replicas for a batch of keys and grant each found object a read lease.
-- KEYS: none
-- ARGV: [1] prefix, [2] lease in ms (0: no lease and no access-time update, as exists() wants),
--       [3..n] keys
-- Returns: {now_ms, r1, r2, ...} where ri is false when the key has no COMPLETE replica on a live
-- node, else {size, dtype, shape, checksum, version, replicas_json, lease_until}. Replicas on nodes
-- past their heartbeat deadline are left out. While the lease runs, no replica of the object is
-- freed, evicted or moved (see bury in the prelude).
local lease = tonumber(ARGV[2])
local now = now_ms()
local out = {now}
local hits, misses = 0, 0
local tier_hits = {}
for i = 3, #ARGV do
  local ok = P .. 'o:' .. ARGV[i]
  local f = redis.call('HMGET', ok, 'size', 'dtype', 'shape', 'checksum', 'version', 'replicas', 'lease_until')
  local found = false
  if f[1] then
    local live = {}
    for _, r in ipairs(decode_list(f[6])) do
      if r[6] == 'COMPLETE' and node_live(r[1], now) then table.insert(live, r) end
    end
    if #live > 0 then
      local lease_until = tonumber(f[7] or 0)
      if lease > 0 then
        lease_until = math.max(lease_until, now + lease)
        redis.call('HSET', ok, 'lease_until', lease_until, 'last_access', now)
      end
      found = {f[1], f[2], f[3], f[4], f[5], encode_list(live), lease_until}
      local first = 'hits:' .. live[1][1] .. ':' .. live[1][2]
      tier_hits[first] = (tier_hits[first] or 0) + 1
    end
  end
  if found then hits = hits + 1 else misses = misses + 1 end
  table.insert(out, found)
end
if lease > 0 then
  redis.call('HINCRBY', P .. 'stats', 'hits', hits)
  redis.call('HINCRBY', P .. 'stats', 'misses', misses)
  -- Credited to the first live replica's node and tier: the one a reader on another host takes.
  for name, n in pairs(tier_hits) do redis.call('HINCRBY', P .. 'stats', name, n) end
end
return out
