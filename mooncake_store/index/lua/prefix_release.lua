-- prefix_release: drop the claims a writer holds on a batch of chunk keys, and the pins it holds
-- under its writer id (a store pins the stored chunks its claimed ones hang off, so that no
-- eviction takes them before the claimed chunks are committed under them).
-- KEYS: none
-- ARGV: [1] prefix, [2] writer id, [3..n] object keys
-- Returns: the number of claims released (a claim that expired or passed to another writer stays).
local now = now_ms()
local n = 0
for i = 3, #ARGV do
  local key = ARGV[i]
  local ck = P .. 'claim:' .. key
  if redis.call('GET', ck) == ARGV[2] then
    n = n + redis.call('DEL', ck)
  end
  unpin_key(key, ARGV[2], now)
end
return n
