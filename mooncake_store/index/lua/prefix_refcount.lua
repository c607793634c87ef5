-- prefix_refcount: live pins per object (expired pins are dropped on the way).
-- KEYS: none
-- ARGV: [1] prefix, [2..n] object keys
-- Returns: one integer per key, the number of live pins (0 for a missing object).
local now = now_ms()
local out = {}
for i = 2, #ARGV do
  local key = ARGV[i]
  local n = live_pins(key, now)
  if redis.call('EXISTS', P .. 'o:' .. key) == 1 then
    redis.call('HSET', P .. 'o:' .. key, 'refcount', n)
  end
  table.insert(out, n)
end
return out
