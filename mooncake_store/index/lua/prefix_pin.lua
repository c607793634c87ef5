-- prefix_pin: pin (or renew the pin of) a batch of objects under one pin id.
-- KEYS: none
-- ARGV: [1] prefix, [2] pin id, [3] lease ms, [4..n] object keys
-- Returns: one integer per key: 1 pinned until now + lease, 0 the object is gone (not pinned).
-- A pinned object cannot be removed or replaced (remove.lua, put_commit.lua) until the pin is
-- released or its lease runs out; renewing is calling this again with the same pin id.
local now = now_ms()
local until_ms = now + tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV do
  if redis.call('EXISTS', P .. 'o:' .. ARGV[i]) == 1 then
    pin_key(ARGV[i], ARGV[2], until_ms, now)
    table.insert(out, 1)
  else
    table.insert(out, 0)
  end
end
return out
