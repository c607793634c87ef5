-- victims: a sample of the objects with a replica on one node's tier, with what eviction weighs.
-- KEYS: none
-- ARGV: [1] prefix, [2] node id, [3] tier, [4] sample size
-- Returns: a flat list, 12 fields per candidate:
--   key, size, last_access ms, lease_until ms, live pins, alloc id, chain position (-1: none), dtype,
--   stored children in its prefix chain, the other live nodes holding a replica (comma-separated), the
--   key of its chain parent ("" for none), and 1 if this is the last live copy of an object that a
--   node's death (or a damaged copy, or a copy another node's pressure dropped) left short of its
--   replicas, else 0
-- The last: a replica listed on a node past its heartbeat deadline (dead, not yet reaped), or the
-- object listed for repair here (its dead holder purged, or a copy dropped elsewhere: evict.lua
-- lists it, thinned). Evicted, such a copy loses an object that was stored to outlive one node's
-- loss.
-- Sampling (SRANDMEMBER of the tier's own set, tobj:<node>:<tier>) bounds the work per call like Redis's own approximate LRU; the pure policy
-- in policy/eviction.py ranks the sample. Objects with live pins are still listed (with their
-- count) so the policy, not this script, owns the rule.
-- Read only: live pins are counted (ZCOUNT), not cleaned; the chain counts come in one HMGET at
-- the end (a count that is no integer, a hand edit, is sent as 1: a nil would cut the reply
-- short there). A call costs two commands per sampled object (three for one stored with several
-- copies and no other live one now), which the start of every pressure pass waits for.
local node, tier = ARGV[2], ARGV[3]
local now = now_ms()
local keys = redis.call('SRANDMEMBER', tier_set(node, tier), tonumber(ARGV[4]))
local out = {}
local listed = {}  -- keys in the order they are in out, for their children counts
for _, key in ipairs(keys) do
  local f = redis.call('HMGET', P .. 'o:' .. key, 'size', 'last_access', 'lease_until', 'replicas', 'chain_pos', 'dtype',
    'chain_parent', 'copies')
  -- A malformed record is passed over: it failed every pass of its node. The numbers it sends
  -- must be numbers (the agent reads them as such).
  local numbers = tonumber(f[1]) and tonumber(f[2] or 0) and tonumber(f[3] or 0) and tonumber(f[5] or -1)
  local reps = numbers and well_formed_replicas(f[4])
  if reps then
    local others, dead_holder = {}, false
    -- Other nodes with a readable copy: one past its heartbeat deadline is no redundancy.
    for _, r in ipairs(reps) do
      if r[1] ~= node and r[6] == 'COMPLETE' then
        if node_live(r[1], now) then table.insert(others, r[1]) else dead_holder = true end
      end
    end
    -- Only an object stored with more than one copy can be listed for repair: the common single
    -- copy costs no third command.
    local survivor = 0
    if #others == 0 and (dead_holder or ((tonumber(f[8] or 0) or 0) > 1
        and redis.call('SISMEMBER', P .. 'repair:' .. node, key) == 1)) then
      survivor = 1
    end
    for _, r in ipairs(reps) do
      if r[1] == node and r[2] == tier and r[6] == 'COMPLETE' then
        local pins = pins_running(key, now)
        table.insert(out, key)
        table.insert(out, f[1])
        table.insert(out, f[2] or 0)
        table.insert(out, f[3] or 0)
        table.insert(out, pins)
        table.insert(out, r[5])
        table.insert(out, f[5] or -1)
        table.insert(out, f[6] or '|u1')
        table.insert(out, 0)  -- the children count, filled in below
        table.insert(listed, key)
        table.insert(out, table.concat(others, ','))
        table.insert(out, f[7] or '')
        table.insert(out, survivor)
      end
    end
  end
end
for i, c in ipairs(chunked('HMGET', P .. 'children', listed)) do out[(i - 1) * 12 + 9] = tonumber(c or 0) or 1 end
return out
