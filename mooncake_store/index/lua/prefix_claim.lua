-- prefix_claim: decide, for a batch of chunk keys, who writes each missing one.
-- KEYS: none
-- ARGV: [1] prefix, [2] writer id, [3] claim ttl ms, [4..n] object keys
-- Returns: one status per key: "HAVE" (a COMPLETE replica on a live node: do not write),
-- "MINE" (claimed for this writer until now + ttl: write it, then release), "BUSY" (another
-- writer holds the claim: leave it to that writer). A writer that dies loses its claims after
-- ttl ms, and the next store writes those chunks.
local now = now_ms()
local out = {}
for i = 4, #ARGV do
  local key = ARGV[i]
  if readable(key, now) then
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
