-- prefix_unpin: release one pin id from a batch of objects.
-- KEYS: none
-- ARGV: [1] prefix, [2] pin id, [3..n] object keys
-- Returns: the number of pins removed (expired or already released pins are not counted).
local now = now_ms()
local n = 0
for i = 3, #ARGV do
  local key = ARGV[i]
  n = n + redis.call('ZREM', P .. 'pins:' .. key, ARGV[2])
  if redis.call('EXISTS', P .. 'o:' .. key) == 1 then
    redis.call('HSET', P .. 'o:' .. key, 'refcount', live_pins(key, now))
  else
    redis.call('DEL', P .. 'pins:' .. key)
  end
end
return n
