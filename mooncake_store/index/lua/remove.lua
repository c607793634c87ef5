-- remove: delete a batch of objects.
-- KEYS: none
-- ARGV: [1] prefix, [2..n] keys
-- Returns: one status per key: 1 removed, 0 absent, "PINNED" (live pins: left in place),
-- "MALFORMED" (a record this build cannot read, a replica list or a lease_until, or whose chain
-- parent's count is no number: left in place, untouched).
-- The replicas go to their agents' graveyards and are freed only after the object's last read
-- lease has run out, so a reader that looked the key up before the remove still reads whole bytes.
local now = now_ms()
local out = {}
for i = 2, #ARGV do
  local key = ARGV[i]
  local ok = P .. 'o:' .. key
  local f = record_fields(ok, 'replicas', 'lease_until', 'chain_parent')
  local reps = f and f[1] and sound_record(f[1], f[2]) and well_formed_replicas(f[1])
  if not f then
    table.insert(out, 'MALFORMED')  -- not a hash: left in place, untouched
  elseif not f[1] then
    table.insert(out, 0)
  elseif live_pins(key, now) > 0 then
    table.insert(out, 'PINNED')
  elseif not reps or not children_ok(f[3]) then
    -- Checked before anything is written: Redis keeps a failing script's earlier writes, and a
    -- record buried and then failed on was left naming freed memory.
    table.insert(out, 'MALFORMED')
  else
    drop_object(key)
    bury(reps, key, math.max(now, tonumber(f[2] or 0)))
    table.insert(out, 1)
  end
end
return out
