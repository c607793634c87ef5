-- remove: delete a batch of objects.
-- KEYS: none
-- ARGV: [1] prefix, [2..n] keys
-- Returns: one status per key: 1 removed, 0 absent, "PINNED" (live pins: left in place).
-- The replicas go to their agents' graveyards and are freed only after the object's last read
-- lease has run out, so a reader that looked the key up before the remove still reads whole bytes.
local now = now_ms()
local out = {}
for i = 2, #ARGV do
  local key = ARGV[i]
  local ok = P .. 'o:' .. key
  local f = redis.call('HMGET', ok, 'replicas', 'lease_until')
  if not f[1] then
    table.insert(out, 0)
  elseif live_pins(key, now) > 0 then
    table.insert(out, 'PINNED')
  else
    -- The record goes before its replicas are buried: what can fail on a malformed record (its
    -- decode, the parent's child count) then fails with the record whole, never buried under it.
    local reps = decode_list(f[1])
    drop_object(key)
    bury(reps, key, math.max(now, tonumber(f[2] or 0)))
    table.insert(out, 1)
  end
end
return out
