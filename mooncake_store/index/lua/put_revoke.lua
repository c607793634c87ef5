-- put_revoke: abandon pending puts (the writer failed before commit).
-- KEYS: none
-- ARGV: [1] prefix, [2..n] put ids
-- Returns: the number of pending records removed. The writer then asks the agents to free the
-- reserved space; if it dies first, the agents reclaim it after their reservation timeout.
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('DEL', P .. 'pend:' .. ARGV[i])
end
return n
