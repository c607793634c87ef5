-- prefix_claim: decide, for a batch of chunk keys, who writes each missing one.
-- KEYS: none
-- ARGV: [1] prefix, [2] writer id, [3] claim ttl ms, [4..n] object keys
-- Returns: one status per key: "HAVE" (a COMPLETE replica on a live node: do not write),
-- "MINE" (claimed for this writer until now + ttl: write it, then release), "BUSY" (another
-- writer holds the claim: leave it to that writer). A writer that dies loses its claims after
-- ttl ms, and the next store writes those chunks.
-- A stored chunk (HAVE) counts as accessed now: a store of a prompt means an engine is using its
-- prefix (commonly a load came first, but a store alone extends a chain too), and eviction cuts
-- a chain back from its leaves by the coldness of its earlier chunks (evict_chains.lua): an old
-- prefix that a new store extends would otherwise be the coldest, and its newest chunks go first.
local now = now_ms()
local out = {}
for i = 4, #ARGV do
  local key = ARGV[i]
  if readable(key, now) then
    redis.call('HSET', OBJ .. key, 'last_access', now)
    table.insert(out, 'HAVE')
  else
    local ck = P .. 'claim:' .. key
    if redis.call('SET', ck, ARGV[2], 'NX', 'PX', ARGV[3]) then
      table.insert(out, 'MINE')
    elseif redis.call('GET', ck) == ARGV[2] then
      redis.call('PEXPIRE', ck, ARGV[3])
      table.insert(out, 'MINE')
    else
      table.insert(out, 'BUSY')
    end
  end
end
return out
