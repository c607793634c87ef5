-- move_replicas: compare-and-swap a batch of one node's replicas to new locations, each entry on its
-- own and with move_replica.lua's rules (DESIGN.md §3.4: copy, swap, then free), in one round trip.
-- KEYS: none
-- ARGV: [1] prefix, [2] old node, then four per entry: key, old alloc id, new replica JSON
--       [node, tier, offset, size, alloc_id, state], guard put id of the new location's
--       reservation ("" for none)
-- Returns: one status per entry, in order: "OK" the object now lists the new location and the old
--   one is in its agent's graveyard (freed once the object's read leases have run out); "GONE" the
--   object no longer holds the old location (removed, replaced or moved meanwhile: drop the new
--   copy); "PINNED" the object has live pins and must not move (drop the new copy); "EXPIRED" the
--   new location's agent already reclaimed its reservation (a slow copy): the guard record
--   pend:<put id> is gone, so the swap would name freed memory.
-- The guard is what the target agent's sync deletes when the reservation times out; deleting it
-- here, in the same atomic step as the swap, decides the race either way.
-- Each new location's agent is told through its ack list, exactly as for a commit.
local old_node = ARGV[2]
local now = now_ms()
local out = {}
for i = 3, #ARGV - 3, 4 do
  local key, old_alloc, guard = ARGV[i], ARGV[i + 1], ARGV[i + 3]
  local ok = P .. 'o:' .. key
  local f = redis.call('HMGET', ok, 'replicas', 'lease_until')
  local status = 'GONE'
  if f[1] then
    local reps = decode_list(f[1])
    local new = cjson.decode(ARGV[i + 2])
    local found, done = nil, false
    for j, r in ipairs(reps) do
      if r[1] == old_node and r[5] == old_alloc and r[6] == 'COMPLETE' then found = j end
      -- Already swapped: this is a retry of a call whose reply was lost. Answer as the first call
      -- did, or the caller would free a copy the index names.
      if r[1] == new[1] and r[5] == new[5] then done = true end
    end
    if done then
      status = 'OK'
    elseif guard ~= '' and redis.call('DEL', P .. 'pend:' .. guard) == 0 then
      status = 'EXPIRED'
    elseif found then
      if live_pins(key, now) > 0 then
        status = 'PINNED'
      else
        new[6] = 'COMPLETE'
        reps[found] = new
        redis.call('HSET', ok, 'replicas', encode_list(reps))
        redis.call('ZADD', P .. 'gc:' .. old_node, math.max(now, tonumber(f[2] or 0)), old_alloc)
        local still_there = false
        for _, r in ipairs(reps) do if r[1] == old_node then still_there = true end end
        if not still_there then redis.call('SREM', P .. 'nobj:' .. old_node, key) end
        redis.call('SADD', P .. 'nobj:' .. new[1], key)
        redis.call('RPUSH', P .. 'acks:' .. new[1], new[5])
        status = 'OK'
      end
    end
  end
  table.insert(out, status)
end
return out
