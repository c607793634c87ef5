-- prefix_match: length of the longest readable run of a chunk chain, optionally pinning it.
-- KEYS: none
-- ARGV: [1] prefix, [2] pin lease ms (0: match only, nothing is written), [3] pin id,
--       [4] the chain's object keys joined by "\n", first chunk first (one argument rather than
--       one per key: it halves the client's cost of sending a long chain)
-- Returns: {now_ms, count}: count is the number of leading keys that each have a COMPLETE
-- replica on a live node; the walk stops at the first that has none (missing, pending only, or
-- only on nodes past their heartbeat deadline). With a lease, each of those count objects gets
-- the pin id with expiry now + lease in pins:<key>, and its refcount field is updated.
-- The walk is the hot loop of a match (one HGET per chunk), so it holds its functions in locals
-- and judges the common record, one COMPLETE replica as cjson wrote it, without decoding it;
-- anything else goes through readable() of the prefix prelude (the rule of lookup.lua).
local lease = tonumber(ARGV[2])
local now = now_ms()
local chain, pos = ARGV[4], 1
local last = #chain
local call, find, sub, match = redis.call, string.find, string.sub, string.match
local count = 0
local matched = {}
while pos <= last do
  local stop = find(chain, '\n', pos, true) or (last + 1)
  local key = sub(chain, pos, stop - 1)
  local reps = call('HGET', OBJ .. key, 'replicas')
  if not reps then break end
  local node
  if sub(reps, -13) == ',"COMPLETE"]]' and not find(reps, '],[', 1, true) then
    node = match(reps, '^%[%["([^"\\]*)"')
  end
  local ok
  if node then ok = node_live(node, now) else ok = readable(key, now) end
  if not ok then break end
  count = count + 1
  if lease > 0 then matched[count] = key end
  pos = stop + 1
end
if lease > 0 then
  for i = 1, count do pin_key(matched[i], ARGV[3], now + lease, now) end
end
return {now, count}
