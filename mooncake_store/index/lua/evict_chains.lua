-- evict_chains: the last resort of a pressure pass whose remaining victims are chain chunks that
-- later chunks of their chain hang off, stored on other nodes (a chain spread over nodes by
-- placement or by spills). evict.lua keeps such a chunk (PARENT), and the node holding the later
-- chunks may be under its own high watermark, never asked to evict them: no node made room, and a
-- put waiting for this one failed with the cluster full of evictable chunks. Here a candidate (this
-- node's last readable copy of a chunk) goes together with every later chunk of its chain, wherever
-- they are, leaves first, so the chain stays prefix-closed as evict.lua keeps it. A candidate goes
-- whole or not at all: not if it or a later chunk is pinned or read (a live lease), nor if more
-- than ARGV[5] chunks hang off it, nor if a later chunk is on another tier of this node that is
-- under pressure (ARGV[6]): that tier's own pass moves those (demotes them, or evicts them leaves
-- first) and this chunk can then be demoted; run before it (the passes go GPU, host, disk), this
-- script evicted whole chains that the next pass of the same wake would have kept on disk. A
-- later chunk on a tier of this node not under pressure goes with the chain: no pass of that tier
-- runs, and a tier just under its high watermark takes no demotion either. Those with the fewest
-- later chunks go first (the input order, coldest first, breaks ties), until ARGV[4] bytes of this
-- node's tier went.
-- KEYS: none
-- ARGV: [1] prefix, [2] node, [3] tier, [4] bytes wanted, [5] most later chunks per candidate,
--       [6] this node's other tiers under pressure (comma-separated, may be empty), then two per
--       candidate: key, alloc id
-- Returns: {bytes of node's tier freed, objects evicted in all, then per candidate a status: "OK",
--   "GONE" (no such replica any more), "PINNED" or "LEASED" (it or a later chunk), "LONG" (more
--   than ARGV[5] later chunks), "LOCAL" (a later chunk on a tier of ARGV[6] here), "PARENT"
--   (a children set that does not name the stored children), "SKIPPED" (enough went before it), or
--   evict.lua's status for itself}
local node, tier = ARGV[2], ARGV[3]
local wanted, most = tonumber(ARGV[4]), tonumber(ARGV[5])
local pressed = {}
for t in string.gmatch(ARGV[6], '[^,]+') do pressed[t] = true end
local FIRST = 7  -- the first candidate's key
local now = now_ms()

-- The chunks after key in its chain, parents before children; or why they cannot be named:
-- "LONG" (more than `most`), "PARENT" (a set that disagrees with its count, or names a chunk not
-- stored under that parent: it cannot be trusted to name every chunk that would be cut off; never
-- written so, but an index restored from a snapshot older than the sets, or written by an agent
-- of an older version, has counts without them).
local function later_chunks(key)
  local out, seen, i = {}, {[key] = true}, 0
  local parent = key
  while parent do
    local kids = redis.call('SMEMBERS', P .. 'kids:' .. parent)
    if #kids ~= children_of(parent) then return nil, 'PARENT' end
    for _, k in ipairs(kids) do
      if redis.call('HGET', P .. 'o:' .. k, 'chain_parent') ~= parent then return nil, 'PARENT' end
      if not seen[k] then
        if #out >= most then return nil, 'LONG' end
        seen[k] = true
        out[#out + 1] = k
      end
    end
    i = i + 1
    parent = out[i]
  end
  return out
end

-- Why this candidate may not go now (nil: it may), and its later chunks.
local function refusal(key, alloc)
  local f = redis.call('HMGET', P .. 'o:' .. key, 'replicas', 'lease_until')
  if not f[1] then return 'GONE' end
  local here, elsewhere = false, false
  for _, r in ipairs(decode_list(f[1])) do
    if r[1] == node and r[5] == alloc then
      here = true
    elseif r[6] == 'COMPLETE' and node_live(r[1], now) then
      elsewhere = true
    end
  end
  if not here then return 'GONE' end
  -- Another readable copy keeps the chain whole: this replica goes alone (as evict.lua lets it).
  local later, why = {}, nil
  if not elsewhere then later, why = later_chunks(key) end
  if later == nil then return why end
  for i, k in ipairs({key, unpack(later)}) do
    local g = redis.call('HMGET', P .. 'o:' .. k, 'replicas', 'lease_until')
    if i > 1 then  -- a later chunk
      for _, r in ipairs(decode_list(g[1])) do
        if r[1] == node and r[2] ~= tier and pressed[r[2]] then return 'LOCAL' end
      end
    end
    if live_pins(k, now) > 0 then return 'PINNED' end
    if tonumber(g[2] or 0) > now then return 'LEASED' end
  end
  return nil, later
end

local order, statuses, depth = {}, {}, {}
local count = (#ARGV - FIRST + 1) / 2
for n = 1, count do
  order[n] = n
  local why, later = refusal(ARGV[FIRST + 2 * n - 2], ARGV[FIRST + 2 * n - 1])
  statuses[n] = why or false  -- false: it may go
  depth[n] = later and #later or 0
end
table.sort(order, function(a, b)
  if depth[a] ~= depth[b] then return depth[a] < depth[b] end
  return a < b
end)

local freed, evicted = 0, 0
for _, n in ipairs(order) do
  local key, alloc = ARGV[FIRST + 2 * n - 2], ARGV[FIRST + 2 * n - 1]
  if not statuses[n] and freed >= wanted then
    statuses[n] = 'SKIPPED'
  elseif not statuses[n] then
    -- Again, as of now: an earlier candidate may have taken some of its later chunks.
    local why, later = refusal(key, alloc)
    if why then
      statuses[n] = why
    else
      for j = #later, 1, -1 do  -- leaves first: each one's parent loses its last child last
        local k = later[j]
        local f = redis.call('HMGET', P .. 'o:' .. k, 'replicas', 'lease_until')
        if f[1] then
          local reps = decode_list(f[1])
          for _, r in ipairs(reps) do
            if r[1] == node and r[2] == tier then freed = freed + tonumber(r[4]) end
          end
          bury(reps, k, math.max(now, tonumber(f[2] or 0)))
          count_lost(P .. 'o:' .. k, 'evictions', reps, {})
          drop_object(k)
          evicted = evicted + 1
        end
      end
      local f = redis.call('HMGET', P .. 'o:' .. key, 'replicas')
      local size = 0
      for _, r in ipairs(decode_list(f[1])) do
        if r[1] == node and r[5] == alloc then size = tonumber(r[4]) end
      end
      statuses[n] = evict_replica(key, node, alloc, now)
      if statuses[n] == 'OK' then
        freed = freed + size
        evicted = evicted + 1
      end
    end
  end
end
local out = {freed, evicted}
for n = 1, count do out[#out + 1] = statuses[n] end
return out
