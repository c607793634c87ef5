-- repair_candidates: objects one node is to copy to another node, to restore the replica count
-- they were stored with after a dead node's purge took one, a damaged copy was dropped, or a full
-- node dropped one under pressure (prelude.lua: note_short, evict_replica).
-- KEYS: none
-- ARGV: [1] prefix, [2] node id, [3] most candidates
-- Returns: a flat list, 8 fields per candidate: key, size, alloc id and tier of the node's replica,
--   replicas still missing, the nodes holding a replica (comma-separated: none is a target), dtype
--   ("" for none), "1" when the copy missing is one a full node dropped (copied only into room
--   under a peer's low watermark) else "0".
-- Keys that need nothing more from this node leave its set here: the object is gone, it has its
-- count of readable replicas again, or this node holds no readable replica of it (then the next
-- live holder's set lists it, if it is still short).
local node = ARGV[2]
local now = now_ms()
local set = P .. 'repair:' .. node
local out = {}
for _, key in ipairs(redis.call('SRANDMEMBER', set, tonumber(ARGV[3]))) do
  local f = redis.call('HMGET', P .. 'o:' .. key, 'size', 'replicas', 'copies', 'dtype', 'thinned')
  local mine, holders = nil, {}
  -- A malformed record (written by hand, or by another build) is passed over and left as it is,
  -- listed: raised, it failed every call, and the other objects of the list stayed short for good.
  local reps = f[1] and well_formed_replicas(f[2])
  local sound = reps ~= nil or not f[1]
  reps = reps or {}
  for _, r in ipairs(reps) do
    table.insert(holders, r[1])
    if r[1] == node and r[6] == 'COMPLETE' then mine = r end
  end
  local copies = tonumber(f[3] or 0) or 0
  local missing = copies - counted_copies(reps)
  if not sound or (mine and not TIERS[mine[2]]) then
    -- left listed, not returned (a tier this build does not know is as malformed)
  elseif f[1] and missing > 0 and mine then  -- stays listed until its copies land
    local row = {key, f[1], mine[5], mine[2], missing, table.concat(holders, ','), f[4] or '', f[5] == '1' and '1' or '0'}
    for _, v in ipairs(row) do table.insert(out, v) end
  else
    redis.call('SREM', set, key)
    if f[1] and missing > 0 then note_short(key, reps, copies, now) end
  end
end
return out
