-- prefix_release: drop the claims a writer holds on a batch of chunk keys.
-- KEYS: none
-- ARGV: [1] prefix, [2] writer id, [3..n] object keys
-- Returns: the number of claims released (a claim that expired or passed to another writer stays).
local n = 0
for i = 3, #ARGV do
  local ck = P .. 'claim:' .. ARGV[i]
  if redis.call('GET', ck) == ARGV[2] then
    n = n + redis.call('DEL', ck)
  end
end
return n
