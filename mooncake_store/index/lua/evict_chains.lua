-- evict_chains: evict chain chunks, cutting their chains back from the leaves. A pressure pass walks
-- its sample coldest first; a victim that is the last readable copy of a chunk that later chunks
-- hang off comes here: its chain loses later chunks, leaves first, chunk by chunk, then the victim
-- itself, until ARGV[4] bytes of this node's tier went, so the chain stays prefix-closed as
-- evict.lua keeps it. A cold chain's early chunk stands for its later chunks, which no reader has
-- touched since (a load reads a prompt's chunks from the first). Skipped (evict.lua answers
-- PARENT), it let a pass with more objects than its sample evict the warmer leaves the sample held,
-- a hot prompt's among them, while cold chains stayed whole. Cut back only as far as wanted: a
-- chain's first chunk is its oldest (put before the rest), the coldest of an unread chain, and a
-- pass needing one chunk would otherwise evict all of it. Candidates go in the order given
-- (coldest first). The later chunks go wherever they are: the node holding them (a chain spread
-- over nodes by placement or by spills) may be under its own high watermark, never asked to evict
-- them. Nothing of a candidate's chain goes if it or a later chunk is pinned or read (a live
-- lease), if more than ARGV[5] chunks hang off it, or if a later chunk is on another tier of this
-- node that is under pressure (ARGV[6]): that tier's own pass moves those (demotes them, or evicts
-- them leaves first) and this chunk can then be demoted; run before it (the passes go GPU, host,
-- disk), this script evicted whole chains that the next pass of the same wake would have kept on
-- disk. A later chunk on a tier of this node not under pressure goes with the chain: no pass of
-- that tier runs, and a tier just under its high watermark takes no demotion either.
-- Nor if it or a later chunk was accessed after the sample that chose the candidate (ARGV[7]): a
-- store's claim touches the chunks it extends and commits the ones it adds, and a pass that
-- sampled before them cut that prompt back from its new leaves while colder chains stayed.
-- KEYS: none
-- ARGV: [1] prefix, [2] node, [3] tier, [4] bytes wanted, [5] most later chunks per candidate,
--       [6] this node's other tiers under pressure (comma-separated, may be empty), [7] the time
--       (ms) of the sample that chose the candidates, "" for none, then two per candidate: key,
--       alloc id
-- Returns: {bytes of node's tier freed, objects evicted in all, then per candidate a status: "OK",
--   "GONE" (no such replica any more), "PINNED", "LEASED" or "TOUCHED" (it or a later chunk), "LONG" (more
--   than ARGV[5] later chunks), "LOCAL" (a later chunk on a tier of ARGV[6] here, or, for a
--   disk pass, on a faster tier here), "PARENT"
--   (a children set that does not name the stored children), "MALFORMED" (a record of its chain
--   this build cannot read: nothing of the chain goes), "SKIPPED" (enough went before it),
--   "TRIMMED" (enough went with some of its later chunks: it stays, with the rest), or evict.lua's
--   status for itself; then the alloc ids of node's tier that went (bytes freed counts their plain
--   sizes, and a disk tier's room is the blocks of their files)}
local node, tier = ARGV[2], ARGV[3]
local wanted, most = tonumber(ARGV[4]), tonumber(ARGV[5])
local pressed = {}
for t in string.gmatch(ARGV[6], '[^,]+') do pressed[t] = true end
local since = tonumber(ARGV[7])
local FIRST = 8  -- the first candidate's key
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
  if not sound_record(f[1], f[2]) then return 'MALFORMED' end
  local here, elsewhere = false, false
  for _, r in ipairs(record_replicas(key, f[1])) do
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
    local g = redis.call('HMGET', P .. 'o:' .. k, 'replicas', 'lease_until', 'last_access')
    -- Checked before the first chunk of any candidate goes: an error here failed the script
    -- after the candidates before it had been evicted.
    if g[1] and not sound_record(g[1], g[2]) then return 'MALFORMED' end
    if i > 1 then  -- a later chunk
      for _, r in ipairs(record_replicas(k, g[1])) do
        if r[1] == node and r[2] ~= tier and pressed[r[2]] then return 'LOCAL' end
        -- A disk pass leaves a chain whose later chunks are in a faster tier of this node: they
        -- are warmer, and cut with it they free none of the disk's room. The host demotes a
        -- prompt's oldest chunks there, and a disk pass wanting one block cut the chain at one,
        -- its whole tail in the host with it (a 16 MiB host tier left empty beside 8 MiB of
        -- disk); the host's own pass cuts such a chain from its leaves instead.
        if tier == 'disk' and r[1] == node and r[2] ~= 'disk' then return 'LOCAL' end
      end
    end
    if live_pins(k, now) > 0 then return 'PINNED' end
    if tonumber(g[2] or 0) > now then return 'LEASED' end
    -- At or after the sample's millisecond (evict_replica says why).
    if since and (tonumber(g[3]) or 0) >= since then return 'TOUCHED' end
  end
  return nil, later
end

local statuses = {}
local count = (#ARGV - FIRST + 1) / 2
local freed, evicted = 0, 0
local gone_here = {}  -- alloc ids of node's tier that went: the caller counts their real room

-- Drop one chunk whose later chunks are gone (every replica, wherever it is), counting what it
-- frees on node's tier.
local function drop_later(k)
  local f = redis.call('HMGET', P .. 'o:' .. k, 'replicas', 'lease_until')
  if not f[1] then return end
  local reps = record_replicas(k, f[1])
  for _, r in ipairs(reps) do
    if r[1] == node and r[2] == tier then
      freed = freed + tonumber(r[4])
      table.insert(gone_here, r[5])
    end
  end
  bury(reps, k, math.max(now, tonumber(f[2] or 0)))
  count_lost(P .. 'o:' .. k, 'evictions', reps, {})
  drop_object(k)
  evicted = evicted + 1
end

for n = 1, count do  -- in the caller's order: coldest first
  local key, alloc = ARGV[FIRST + 2 * n - 2], ARGV[FIRST + 2 * n - 1]
  -- As of now: an earlier candidate may have taken some of its later chunks.
  local why, later = refusal(key, alloc)
  if why then
    statuses[n] = why
  elseif freed >= wanted then
    statuses[n] = 'SKIPPED'
  else
    -- Later chunks from the end of the list (parents before children: any tail of it holds every
    -- chunk that hangs off one in it), so the chain stays prefix-closed wherever this stops.
    for j = #later, 1, -1 do
      drop_later(later[j])
      if freed >= wanted then
        statuses[n] = 'TRIMMED'  -- the chain cut back from its leaves as far as wanted; the rest stays
        break
      end
    end
    if not statuses[n] then
      local f = redis.call('HMGET', P .. 'o:' .. key, 'replicas')
      local size = 0
      for _, r in ipairs(record_replicas(key, f[1])) do
        if r[1] == node and r[5] == alloc then size = tonumber(r[4]) end
      end
      statuses[n] = evict_replica(key, node, alloc, now, false, since)
      if statuses[n] == 'OK' then
        freed = freed + size
        evicted = evicted + 1
        table.insert(gone_here, alloc)
      end
    end
  end
end
local out = {freed, evicted}
for n = 1, count do out[#out + 1] = statuses[n] end
for _, a in ipairs(gone_here) do out[#out + 1] = a end
return out
