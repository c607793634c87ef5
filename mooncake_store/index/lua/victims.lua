-- victims: a sample of the objects with a replica on one node's tier, with what eviction weighs.
-- KEYS: none
-- ARGV: [1] prefix, [2] node id, [3] tier, [4] sample size
-- Returns: a flat list, 11 fields per candidate:
--   key, size, last_access ms, lease_until ms, live pins, alloc id, chain position (-1: none), dtype,
--   stored children in its prefix chain, the other live nodes holding a replica (comma-separated), the
--   key of its chain parent ("" for none)
-- Sampling (SRANDMEMBER of the tier's own set, tobj:<node>:<tier>) bounds the work per call like Redis's own approximate LRU; the pure policy
-- in policy/eviction.py ranks the sample. Objects with live pins are still listed (with their
-- count) so the policy, not this script, owns the rule.
-- Read only: live pins are counted (ZCOUNT), not cleaned; the chain counts come in one HMGET at
-- the end (a count that is no integer, a hand edit, is sent as 1: a nil would cut the reply
-- short there). A call costs two commands per sampled object, which the start of every pressure pass
-- waits for.
local node, tier = ARGV[2], ARGV[3]
local now = now_ms()
local keys = redis.call('SRANDMEMBER', tier_set(node, tier), tonumber(ARGV[4]))
local out = {}
local listed = {}  -- keys in the order they are in out, for their children counts
for _, key in ipairs(keys) do
  local f = redis.call('HMGET', P .. 'o:' .. key, 'size', 'last_access', 'lease_until', 'replicas', 'chain_pos', 'dtype',
    'chain_parent')
  -- A malformed record is passed over: it failed every pass of its node. The numbers it sends
  -- must be numbers (the agent reads them as such).
  local numbers = tonumber(f[1]) and tonumber(f[2] or 0) and tonumber(f[3] or 0) and tonumber(f[5] or -1)
  local reps = numbers and well_formed_replicas(f[4])
  if reps then
    local others = {}
    -- Other nodes with a readable copy: one past its heartbeat deadline is no redundancy.
    for _, r in ipairs(reps) do
      if r[1] ~= node and r[6] == 'COMPLETE' and node_live(r[1], now) then table.insert(others, r[1]) end
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
      end
    end
  end
end
for i, c in ipairs(chunked('HMGET', P .. 'children', listed)) do out[(i - 1) * 11 + 9] = tonumber(c or 0) or 1 end
return out
