-- prefix_match: length of the longest readable run of a chunk chain, optionally pinning it.
-- KEYS: none
-- ARGV: [1] prefix, [2] pin lease ms (0: match only, nothing is written), [3] pin id,
--       [4] the chain's object keys joined by "\n", first chunk first (one argument rather than
--       one per key: it halves the client's cost of sending a long chain)
-- Returns: {now_ms, count}: count is the number of leading keys that each have a COMPLETE
-- replica on a live node; the walk stops at the first that has none (missing, pending only, or
-- only on nodes past their heartbeat deadline). With a lease, each of those count objects gets
-- the pin id with expiry now + lease in pins:<key>, and its refcount field is updated.
local lease = tonumber(ARGV[2])
local now = now_ms()
local chain, pos = ARGV[4], 1
local last = #chain
local matched = {}
while pos <= last do
  local stop = string.find(chain, '\n', pos, true) or (last + 1)
  local key = string.sub(chain, pos, stop - 1)
  if not readable(key, now) then break end
  matched[#matched + 1] = key
  pos = stop + 1
end
if lease > 0 then
  for _, key in ipairs(matched) do pin_key(key, ARGV[3], now + lease, now) end
end
return {now, #matched}
