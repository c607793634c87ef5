-- node_reap: purge nodes whose heartbeat deadline passed more than grace ms ago.
-- KEYS: none
-- ARGV: [1] prefix, [2] grace ms, [3] max keys per call
-- Returns: the ids of the nodes purged completely in this call. Readers already skip such nodes
-- (lookup checks the deadline); reaping only removes their records.
local now = now_ms()
local budget = tonumber(ARGV[3])
local dead = redis.call('ZRANGEBYSCORE', P .. 'hb', '-inf', '(' .. (now - tonumber(ARGV[2])), 'LIMIT', 0, 16)
local done = {}
for _, node in ipairs(dead) do
  if budget <= 0 then break end
  local n = redis.call('SCARD', P .. 'nobj:' .. node)
  if purge_node(node, budget) == 0 then table.insert(done, node) end
  budget = budget - n
end
return done
