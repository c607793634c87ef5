-- lookup: find readable replicas for a batch of keys and grant each found object a read lease.
-- KEYS: none
-- ARGV: [1] prefix, [2] lease in ms (0: no lease and no access-time update, as exists() wants),
--       [3] "1" to count the keys in stats as hits and misses (with a lease only): a get's retry
--       of keys its first lookup counted passes "0", so one get is one hit or one miss, [4..n] keys
-- Returns: {now_ms, r1, r2, ...} where ri is false when the key has no COMPLETE replica on a live
-- node, else {size, dtype, shape, checksum, version, replicas_json, lease_until}. Replicas on nodes
-- past their heartbeat deadline are left out. While the lease runs, no replica of the object is
-- freed or evicted; one moved meanwhile (a demotion, promotion or spill: plan_swap in the prelude)
-- leaves its old copy in the graveyard until the lease ends (see bury in the prelude), so a reader
-- under the lease still reads whole bytes there. lease_until is when this object's lease ends:
-- at least now + 0.9 * lease. A lease that already reaches that far is not rewritten (nor
-- last_access, which is then at most lease / 10 old), so an object read in a hot loop costs one
-- write per lease / 10 instead of one per read. The 0.9 keeps readers that budget their reads
-- at 0.8 * lease (LEASE_SAFETY) safe; lease_until - now_ms is the exact budget.
local lease = tonumber(ARGV[2])
local counted = lease > 0 and ARGV[3] == '1'
local now = now_ms()
local renew_before = now + lease - math.floor(lease / 10)
local out = {now}
local hits = 0
local tier_hits = {}
local TIER_RANK = {host = 0, gpu = 1, disk = 2}
for i = 4, #ARGV do
  local ok = P .. 'o:' .. ARGV[i]
  local f = redis.call('HMGET', ok, 'size', 'dtype', 'shape', 'checksum', 'version', 'replicas', 'lease_until')
  local found = false
  if f[1] then
    local reps = f[6] or ''
    local node, tier = sole_complete(reps)
    if node then
      -- One COMPLETE replica: returned as stored when its node is live.
      if not node_live(node, now) then reps = nil end
    else
      local live, best = {}, nil
      for _, r in ipairs(record_replicas(ARGV[i], reps)) do
        if r[6] == 'COMPLETE' and node_live(r[1], now) then
          live[#live + 1] = r
          -- Hits go to the replica a reader on another host takes: the cheapest tier.
          if best == nil or (TIER_RANK[r[2]] or 9) < (TIER_RANK[best[2]] or 9) then best = r end
        end
      end
      if #live > 0 then
        reps, node, tier = encode_list(live), best[1], best[2]
      else
        reps = nil
      end
    end
    if reps then
      local lease_until = tonumber(f[7]) or 0
      if lease > 0 and lease_until < renew_before then
        lease_until = math.max(lease_until, now + lease)
        redis.call('HSET', ok, 'lease_until', lease_until, 'last_access', now)
      end
      found = {f[1], f[2], f[3], f[4], f[5], reps, lease_until}
      hits = hits + 1
      -- Credited to the cheapest live replica's node and tier: the one a reader on another host takes.
      local name = 'hits:' .. node .. ':' .. tier
      tier_hits[name] = (tier_hits[name] or 0) + 1
    end
  end
  out[#out + 1] = found
end
if counted then
  local misses = #ARGV - 3 - hits
  if hits > 0 then add_stat('hits', hits) end
  if misses > 0 then add_stat('misses', misses) end
  for name, n in pairs(tier_hits) do add_stat(name, n) end
end
return out
