-- prefix_unpin: release one pin id from a batch of objects.
-- KEYS: none
-- ARGV: [1] prefix, [2] pin id, [3..n] object keys
-- Returns: the number of pins removed (an expired pin still listed counts; a released one does not).
local now = now_ms()
local n = 0
for i = 3, #ARGV do
  n = n + unpin_key(ARGV[i], ARGV[2], now)
end
return n
