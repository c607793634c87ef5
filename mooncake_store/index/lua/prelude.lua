-- Shared prelude, prepended to every script by index/scripts.py.
-- Every key lives under one hash-tagged prefix "mc:{ns}:" (ARGV[1] of every script), so all keys
-- of a namespace hash to one slot; keys derived here from node ids (nobj:, tobj:, gc:, acks:)
-- share that tag. Not Redis Cluster support: the keys come through ARGV, not KEYS (schema.py).
-- Replica encoding (compact JSON array): [node_id, tier, offset, size, alloc_id (string), state]
local P = ARGV[1]
-- Scripts write after TIME (and SRANDMEMBER): effects replication, the default since Redis 5 and
-- the only mode of Redis 7 and Valkey; Redis 6.2 with lua-replicate-commands off would refuse
-- every write after them. Asked for here, before any command (a no-op where it is the default).
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- A heartbeat or registration of some node landed. When none had for longer than ``ttl`` (the
-- caller's TTL), the index itself was out of reach (stalled, out of memory, restarted from a
-- snapshot), and every node missed its deadline at once: the first reaper back would purge healthy
-- peers with all their objects. Each node is given its own grace (its reap time less its
-- deadline) again from now: a live one heartbeats within it, a dead one is reaped one grace later.
-- node_reap.lua reaps nothing while the last landing is older than its caller's TTL, nor a node
-- whose grace that silence passed.
-- ``outage_after`` (ms): a silence past it is an outage too, and each node whose grace the silence
-- passed gets it again. A heartbeat gives twice its agent's interval (its own beats stopped
-- landing); a registration 0 (rare: any node whose grace the silence passed). Judged by the
-- caller's TTL alone, a 4 s outage was none to a node with a 10 s TTL beating every 0.1 s, whose
-- beat (or registration) landed first and whose reap then purged a healthy peer with a 1.5 s TTL,
-- and all its objects.
local function heard_from_a_node(now, ttl, outage_after)
  local last = tonumber(redis.call('GET', P .. 'hb_last') or '0')
  local silence = now - last
  local outage = last > 0 and (silence > ttl or (outage_after ~= nil and silence > outage_after))
  if outage then
    local reaps = redis.call('ZRANGE', P .. 'reap', 0, -1, 'WITHSCORES')
    for i = 1, #reaps, 2 do
      local reap_at = tonumber(reaps[i + 1])
      local deadline = tonumber(redis.call('ZSCORE', P .. 'hb', reaps[i]) or reap_at)
      local grace = reap_at - deadline
      -- A deadline of 0 is a node leaving (node_deregister): no grace to give it again. A TTL is
      -- at most a day (config), so a larger "grace" is no TTL. A silence past the caller's TTL
      -- gives every node its grace again (as before the interval was given); a shorter one, those
      -- whose grace it passed.
      local missed = silence > ttl or silence > grace
      if deadline > 0 and grace > 0 and grace <= 86400000 and missed and reap_at < now + grace then
        redis.call('ZADD', P .. 'reap', now + grace, reaps[i])
      end
    end
  end
  redis.call('SET', P .. 'hb_last', now)
end

local function decode_list(s)
  if not s or s == '' then return {} end
  local ok, v = pcall(cjson.decode, s)
  if not ok then
    -- Said as what it is (a record written by hand or by another build), not cjson's words.
    error('malformed list in an index record: ' .. string.sub(s, 1, 80), 0)
  end
  if type(v) ~= 'table' then return {} end
  return v
end
-- A record's replica list, or nil when it is malformed (written by hand or by another build):
-- what walks a node's objects (a pressure pass's sample, a dead node's purge) passes such a record
-- over, where one of them failed every pass of the node, and every reap of it and of the nodes
-- after it in the same call.
local function well_formed_replicas(raw)
  local ok, reps = pcall(decode_list, raw)
  if not ok then return nil end
  for _, r in ipairs(reps) do
    -- Types, not nil: cjson decodes a JSON null as cjson.null, which is no nil.
    -- The offset and size too: a size that is no number passed, and an eviction then failed on
    -- its arithmetic after the chains before it had gone.
    if type(r) ~= 'table' or type(r[1]) ~= 'string' or type(r[2]) ~= 'string'
        or type(r[3]) ~= 'number' or type(r[4]) ~= 'number'
        or (type(r[5]) ~= 'string' and type(r[5]) ~= 'number') then
      return nil
    end
  end
  return reps
end
-- Whether the fields of a record that removes, replacements, moves and evictions read are of their
-- types: its replica list, and its lease_until (a number, or absent). One that is not (written by
-- hand, or by another build) is left as it is, status MALFORMED, before the script writes anything:
-- Redis keeps the writes of a script that fails half-way (a remove deleted the record and then
-- failed before its replicas reached the graveyard: their memory was never freed).
local function sound_record(raw_replicas, lease_until)
  return well_formed_replicas(raw_replicas) ~= nil and (not lease_until or tonumber(lease_until) ~= nil)
end
-- HMGET of a record's fields, or nil when the key holds another type (a string written by hand
-- where the hash is): a WRONGTYPE error failed the script half-way, after its batch's earlier
-- entries were written (Redis keeps them), naming no key; a node's purge failed at every try.
local function record_fields(ok, ...)
  local f = redis.pcall('HMGET', ok, ...)
  if f.err then return nil end
  return f
end
-- A record's replica list, or an error naming the record: a reader or a move cannot pass a
-- malformed one over (it would call a stored object missing), so it says which key to look at,
-- where cjson's own error named neither the key nor the list.
local function record_replicas(key, raw)
  local reps = well_formed_replicas(raw)
  if not reps then
    error('malformed replica list in the index record o:' .. key .. ': ' .. string.sub(raw or '', 1, 80), 0)
  end
  return reps
end
-- Counters are what `stat` shows, nothing depends on them: one that a hand edit left no integer
-- (stat names it) must not fail the read, eviction or move that counts it, after that script's
-- writes (Redis keeps them), so its HINCRBY's error is let go.
local function add_stat(name, n)
  redis.pcall('HINCRBY', P .. 'stats', name, n)
end
local function encode_list(t)
  if #t == 0 then return '[]' end
  return cjson.encode(t)
end
-- Shapes of what clients send, checked before a script writes anything: Redis keeps the writes of
-- a script that fails half-way, so a bad field must be refused up front, not met by a redis.call.
local TIERS = {gpu = true, host = true, disk = true}
local function is_uint(v) return type(v) == 'number' and v >= 0 and v == math.floor(v) and v < 1e14 end
local function is_digits(v) return type(v) == 'string' and string.match(v, '^%d+$') ~= nil end
local function valid_replica(r)
  return type(r) == 'table' and #r == 6 and type(r[1]) == 'string' and r[1] ~= '' and TIERS[r[2]] == true
    and is_uint(r[3]) and is_uint(r[4]) and is_digits(r[5]) and type(r[6]) == 'string'
end
local function valid_entry(e)
  if type(e) ~= 'table' or type(e.put_id) ~= 'string' or type(e.key) ~= 'string' or e.key == ''
      or not is_uint(e.size) or type(e.dtype) ~= 'string' or type(e.shape) ~= 'string'
      or string.match(e.shape, '^[%d,]*$') == nil or not is_digits(e.checksum)
      or type(e.replicas) ~= 'table' or #e.replicas == 0 then
    return false
  end
  if e.chain_pos ~= nil and not is_uint(e.chain_pos) then return false end
  if e.chain_parent ~= nil and (type(e.chain_parent) ~= 'string' or e.chain_parent == '') then return false end
  for _, r in ipairs(e.replicas) do
    if not valid_replica(r) then return false end
  end
  return true
end
-- The common record, a single COMPLETE replica as cjson wrote it, read without decoding the JSON:
-- returns its node id and tier, or nil for anything else (several replicas, another state, a
-- node id with escaped characters), which callers then decode in full.
local function sole_complete(reps)
  if string.sub(reps, -13) ~= ',"COMPLETE"]]' or string.find(reps, '],[', 1, true) then return nil end
  return string.match(reps, '^%[%["([^"\\]*)","([^"\\]*)"')
end
-- A node row (HGET nodes <id>) decoded, or nil when it is no JSON object (written by hand, or by
-- another build): cjson's error failed every registration of the id (a start over a dead node's
-- row, with no other agent to reap it, failed for good), the leave of its agent, and every
-- commit of a put that named the node.
local function node_row(raw)
  if not raw then return nil end
  local ok, rec = pcall(cjson.decode, raw)
  if ok and type(rec) == 'table' then return rec end
  return nil
end
-- Node liveness: a node is live while its heartbeat deadline (zset hb) lies ahead.
local live_cache = {}
local function node_live(node, now)
  local v = live_cache[node]
  if v == nil then
    local d = redis.call('ZSCORE', P .. 'hb', node)
    v = (d ~= false and d ~= nil and tonumber(d) >= now)
    live_cache[node] = v
  end
  return v
end
-- Live pins of an object; expired pins are dropped here, which is how a dead client's pin ends.
-- A pins key that holds no sorted set (written by hand, or by another build) holds no pin this
-- build made, and counts none: its WRONGTYPE error failed every remove, commit, eviction and
-- prefix match of the key (a batch's after the entries before it were written, which Redis keeps).
local function live_pins(key, now)
  local pk = P .. 'pins:' .. key
  if type(redis.pcall('ZREMRANGEBYSCORE', pk, '-inf', '(' .. now)) ~= 'number' then return 0 end
  return redis.call('ZCARD', pk)
end
-- The pins of an object still running at `now`, read only (what samples and swaps ask); 0 for a
-- pins key that holds no sorted set, as live_pins counts it.
local function pins_running(key, now)
  local n = redis.pcall('ZCOUNT', P .. 'pins:' .. key, now, '+inf')
  if type(n) ~= 'number' then return 0 end
  return n
end
-- The keys with a replica on one tier of one node: what a pressure pass samples there (nobj: holds
-- every tier of the node, and a disk tier may list a hundred times the objects of the host tier
-- above it, so a sample of nobj: found few host candidates). Kept beside nobj: by every script
-- that adds, moves or drops a replica; the tier is the last part, and no tier holds a colon.
local TIER_NAMES = {'gpu', 'host', 'disk'}
local function tier_set(node, tier) return P .. 'tobj:' .. node .. ':' .. tier end
-- Whether reps hold a replica on that tier of that node.
local function holds(reps, node, tier)
  for _, r in ipairs(reps) do if r[1] == node and r[2] == tier then return true end end
  return false
end
-- Hand replicas to their agents' graveyards; each agent frees them once free_at has passed,
-- which is never before the last read lease granted on the object ran out.
local function bury(replicas, key, free_at)
  for _, r in ipairs(replicas) do
    redis.call('ZADD', P .. 'gc:' .. r[1], free_at, r[5])
    redis.call('SREM', P .. 'nobj:' .. r[1], key)
    redis.call('SREM', tier_set(r[1], r[2]), key)
  end
end
-- Prefix chains: a chunk names its parent (chain_parent), and the hash "children" counts, per
-- parent key, the stored chunks that name it, so eviction takes only leaves and chains stay
-- prefix-closed across all agents. The count lives apart from the object record, so it survives
-- the parent being removed and stored again while its children stay. The hash "minchild" keeps,
-- per parent key with children, the lowest chain position any child was committed at (never
-- raised: a stale one is only stricter), which put_commit checks a parent's own position against.
-- The set kids:<parent> names the children the count counts: a pressure pass whose victims are all
-- parents of chunks on other nodes evicts a chain's later chunks wherever they are (evict_chains.lua).
local function adjust_children(parent, child, delta)
  if parent and parent ~= '' then
    if delta > 0 then
      redis.call('SADD', P .. 'kids:' .. parent, child)
    else
      redis.call('SREM', P .. 'kids:' .. parent, child)
    end
    -- A count a hand edit left no integer stays as it is (put_commit and remove refuse to
    -- touch its chain, naming it; eviction keeps its parent): failing here would fail the script
    -- after its writes, which Redis keeps.
    local n = redis.pcall('HINCRBY', P .. 'children', parent, delta)
    if type(n) == 'number' and n <= 0 then
      redis.call('HDEL', P .. 'children', parent)
      redis.call('HDEL', P .. 'minchild', parent)
      redis.call('DEL', P .. 'kids:' .. parent)
    end
  end
end
-- Whether adjust_children(parent, ...) can run: the parent's count is absent or a number (a
-- HINCRBY on anything else fails, after the writes a script made before it).
local function children_ok(parent)
  if not parent or parent == '' then return true end
  local n = redis.call('HGET', P .. 'children', parent)
  return not n or string.match(n, '^-?%d+$') ~= nil  -- what HINCRBY takes: "1.5" is no count
end
-- A count that is no integer counts as children without end: its chunk is kept (the safe side).
local function children_of(key)
  return tonumber(redis.call('HGET', P .. 'children', key) or 0) or math.huge
end
-- Remove every trace of one object record, and its place in its parent's child count.
local function drop_object(key)
  adjust_children(redis.call('HGET', P .. 'o:' .. key, 'chain_parent'), key, -1)
  redis.call('DEL', P .. 'o:' .. key, P .. 'pins:' .. key)
  redis.call('SREM', P .. 'keys', key)
end
-- Re-replication: an object records how many replicas it was stored with (copies); one that a
-- dead node's purge leaves with fewer readable ones is listed in repair:<holder>, the set of the
-- first live node that still holds a readable replica, whose agent copies it to another node
-- (repair_candidates.lua, copy_replicas.lua). A damaged copy's drop lists it too, and so does a
-- copy a full node's pressure drops, marked `thinned` (evict_replica): copied back only into room
-- under a peer's low watermark.
local function readable_nodes(reps, now)
  local out = {}
  for _, r in ipairs(reps) do
    if r[6] == 'COMPLETE' and node_live(r[1], now) then table.insert(out, r[1]) end
  end
  return out
end
-- The replicas that count towards an object's copies: complete, on a node still in the node table
-- and not being purged. A holder past its deadline and not yet reaped (a late heartbeat) counts: an
-- object is short once its dead node is reaped (README), and that purge lists it then. Counted as
-- missing at once instead, it was copied again, and the late holder's return left a copy too many.
local function counted_copies(reps)
  local n = 0
  for _, r in ipairs(reps) do
    if r[6] == 'COMPLETE' and redis.call('HEXISTS', P .. 'nodes', r[1]) == 1
        and redis.call('SISMEMBER', P .. 'purging', r[1]) == 0 then
      n = n + 1
    end
  end
  return n
end
local function note_short(key, reps, copies, now)
  if counted_copies(reps) >= copies then return end
  local readable = readable_nodes(reps, now)
  local holder = readable[1]
  if holder == nil then
    -- No holder is live this moment, but one past its deadline and not yet reaped (a late
    -- heartbeat) may be back in a second: the first still in the node table and not being purged
    -- is asked; its own purge hands the object on if it does not come back.
    for _, r in ipairs(reps) do
      if holder == nil and r[6] == 'COMPLETE' and redis.call('HEXISTS', P .. 'nodes', r[1]) == 1
          and redis.call('SISMEMBER', P .. 'purging', r[1]) == 0 then
        holder = r[1]
      end
    end
  end
  if holder then
    -- One holder lists it: listed at two (an earlier purge's holder now late), both copied it and
    -- `short` (the sum of the lists) counted it twice.
    for _, r in ipairs(reps) do
      if r[1] ~= holder then redis.call('SREM', P .. 'repair:' .. r[1], key) end
    end
    redis.call('SADD', P .. 'repair:' .. holder, key)
  end
end
-- An object lost to readers is counted once (stats `evictions`, `corrupt` for damage, `lost`
-- for the last copies purged with their nodes). The
-- mark `lost` lists the replicas left at that loss (",node:alloc,"), all on nodes past their
-- deadlines: one of them dropped later, its node back meanwhile, is no second loss, while a copy
-- made or moved since (a new alloc id) is a new one. put_commit clears the mark.
local function count_lost(ok, what, dropped, left)
  local mark = redis.call('HGET', ok, 'lost')
  if mark then
    local seen = true
    for _, r in ipairs(dropped) do
      if not string.find(mark, ',' .. r[1] .. ':' .. r[5] .. ',', 1, true) then seen = false end
    end
    if seen then return end
  end
  add_stat(what, 1)
  local ids = {}
  for _, r in ipairs(left) do table.insert(ids, r[1] .. ':' .. r[5]) end
  redis.call('HSET', ok, 'lost', ',' .. table.concat(ids, ',') .. ',')
end

-- Strip a node's replicas from the index; bounded per call so a huge node cannot stall Redis.
-- Returns the number of keys still to go (0 when the node is gone from the index).
local function purge_node(node, max_keys)
  local nk = P .. 'nobj:' .. node
  -- Marked until the last step: a heartbeat of the incarnation being purged must not bring the
  -- node back to life with part of its replicas gone (node_heartbeat answers UNKNOWN, and the
  -- agent drops everything and registers again, which finishes the purge first).
  redis.call('SADD', P .. 'purging', node)
  local now = now_ms()
  -- What this node was to copy is handed on first, whether it still holds a replica or not: it may
  -- have moved or evicted its replica since the object was listed, and then the loop below, over
  -- the objects it holds, would not meet the object.
  for _, key in ipairs(redis.call('SPOP', P .. 'repair:' .. node, max_keys)) do
    local f = record_fields(P .. 'o:' .. key, 'replicas', 'copies') or {}
    local reps = f[1] and well_formed_replicas(f[1])
    if reps then
      local others = {}
      for _, r in ipairs(reps) do
        if r[1] ~= node then table.insert(others, r) end
      end
      note_short(key, others, tonumber(f[2] or 0) or 0, now)
    end
  end
  local keys = redis.call('SRANDMEMBER', nk, max_keys)
  -- Replicas that leave here while a read lease on their object runs, by alloc id, scored by the
  -- lease's end: same-host readers copy straight from the node's arena under their lease, so an
  -- agent that comes back (stalled, not dead) must not reuse that memory before then
  -- (node_register tells it; see AllocationTable.drop_after_reap).
  local hk, held = P .. 'held:' .. node, 0
  for _, key in ipairs(keys) do
    local ok = P .. 'o:' .. key
    local f = record_fields(ok, 'replicas', 'copies', 'lease_until') or {}
    local lease = tonumber(f[3] or 0) or 0
    local keep = {}
    local reps = f[1] and well_formed_replicas(f[1])
    if not reps then
      -- Malformed: left to whoever reads it (an error naming it), and out of this node's way.
      reps, keep = {}, nil
    end
    for _, r in ipairs(reps) do
      if r[1] ~= node then
        table.insert(keep, r)
      else
        redis.call('SREM', tier_set(node, r[2]), key)
        if lease > now then
          redis.call('ZADD', hk, lease, tostring(r[5]))
          held = math.max(held, lease)
        end
      end
    end
    if keep == nil then  -- a malformed record, passed over
    elseif #keep == 0 then
      -- Its last copies went with the nodes that held them: counted `lost` (once: one already
      -- counted as it became unreadable, evicted with the rest on this node, is marked so).
      local gone = {}
      for _, r in ipairs(reps) do if r[1] == node then table.insert(gone, r) end end
      count_lost(ok, 'lost', gone, {})
      drop_object(key)
    else
      -- A node's loss: copied again into any room under a peer's high watermark, whatever copy
      -- a full node dropped of it before (evict_replica's `thinned`).
      redis.call('HSET', ok, 'replicas', encode_list(keep))
      redis.call('HDEL', ok, 'thinned')
      note_short(key, keep, tonumber(f[2] or 0) or 0, now)
    end
    redis.call('SREM', nk, key)
  end
  if held > 0 then  -- the set goes once no lease it stands for runs
    local top = redis.call('ZREVRANGE', hk, 0, 0, 'WITHSCORES')
    redis.call('PEXPIREAT', hk, math.max(held, tonumber(top[2])))
  end
  local left = redis.call('SCARD', nk) + redis.call('SCARD', P .. 'repair:' .. node)
  if left == 0 then
    -- Its graves not yet due are old copies of removed, replaced or moved objects whose read
    -- leases still run: no object record names them any more, so the loop above never met them,
    -- and they are held like the replicas it took (same member, alloc id; same score, the end).
    local gk = P .. 'gc:' .. node
    if redis.call('ZCOUNT', gk, '(' .. now, '+inf') > 0 then
      redis.call('ZUNIONSTORE', hk, 2, hk, gk, 'AGGREGATE', 'MAX')
      redis.call('ZREMRANGEBYSCORE', hk, '-inf', now)
      local top = redis.call('ZREVRANGE', hk, 0, 0, 'WITHSCORES')
      redis.call('PEXPIREAT', hk, tonumber(top[2]))
    end
    -- Its repair set is empty by now: what it listed was handed on above (max_keys a call).
    redis.call('DEL', nk, P .. 'gc:' .. node, P .. 'acks:' .. node, P .. 'gcout:' .. node, P .. 'acksout:' .. node,
      P .. 'landed:' .. node, P .. 'repair:' .. node)
    for _, tier in ipairs(TIER_NAMES) do redis.call('DEL', tier_set(node, tier)) end
    -- Its hit counters too: default node ids carry a pid, so stats would grow with every agent.
    -- They are kept in the purge's mark for a day, with its incarnation: an agent reaped while it
    -- stalled registers again under the same one and goes on counting from its start (its uptime
    -- and its own counters do), and node_register gives them back to it.
    local hit_fields = {}
    for i, tier in ipairs(TIER_NAMES) do hit_fields[i] = 'hits:' .. node .. ':' .. tier end
    local hits = redis.call('HMGET', P .. 'stats', unpack(hit_fields))
    local rec = redis.call('HGET', P .. 'nodes', node)
    local ok, decoded = pcall(cjson.decode, rec or '')
    local mark = {incarnation = ok and type(decoded) == 'table' and decoded.incarnation or '', hits = {}}
    for i, tier in ipairs(TIER_NAMES) do mark.hits[tier] = tonumber(hits[i] or 0) or 0 end
    redis.call('HDEL', P .. 'stats', unpack(hit_fields))
    redis.call('HDEL', P .. 'nodes', node)
    redis.call('ZREM', P .. 'hb', node)
    redis.call('ZREM', P .. 'reap', node)
    redis.call('SREM', P .. 'purging', node)
    -- For node_register: the record went by a purge, which recorded the leases on what it took
    -- (held:), not with an index that lost its data, and the leases it had granted with it.
    redis.call('SET', P .. 'purged:' .. node, cjson.encode(mark), 'PX', 86400000)
  end
  return left
end
-- Whether alloc id `alloc` (a decimal string) of node `node` cannot name live memory there: the
-- node left the node table, or the id carries the tag of another incarnation of it than the one
-- registered now (bits 47..62, mooncake_store.types.ALLOC_TAG_SHIFT; a node record without a tag
-- judges nothing). A put reserved before a restart must not commit into the successor's arena.
-- Exact as a double for any id below tag * 2^47 + 2^47 - 2^10.
local node_tags = {}
local function stale_alloc(node, alloc)
  local tag = node_tags[node]
  if tag == nil then
    local raw = redis.call('HGET', P .. 'nodes', node)
    local rec = node_row(raw)  -- a row no JSON decodes names no incarnation to commit into
    tag = rec and (tonumber(rec.alloc_tag) or 0) or -1
    node_tags[node] = tag
  end
  if tag == -1 then return true end
  if tag == 0 then return false end
  return math.floor(tonumber(alloc) / 140737488355328) % 65536 ~= tag
end

-- Run a command once per <= 1000 items (unpack has a stack limit): cmd key item...; returns the
-- replies of a command that answers one value per item (HMGET), in order.
local function chunked(cmd, key, items)
  local replies = {}
  for i = 1, #items, 1000 do
    local r = redis.call(cmd, key, unpack(items, i, math.min(i + 999, #items)))
    if type(r) == 'table' then
      for _, v in ipairs(r) do table.insert(replies, v) end  -- a missing field is false, not nil
    end
  end
  return replies
end
-- Swaps go in two steps, so that a call that fails (a malformed argument or record meets cjson or
-- tonumber) has written nothing: Redis keeps what a script wrote before an error, and a batch
-- half swapped without its acks, graves and guard would name memory its agents then free.
-- plan_swap reads and checks, and keeps the object records it changes (a later entry of the same
-- key sees them); write_swaps then writes each changed record, and each node set, graveyard, ack
-- list and record of landed swaps once, not once per object. A guard may be shared by a batch's
-- entries (one spill batch, one guard): it is looked up once, and deleted if it was there.
local function new_swaps()
  return {guards = {}, records = {}, changed = {}, sadd = {}, srem = {}, zadd = {}, rpush = {}, landed = {},
    tiers = {}}
end
-- How long the index remembers a swap that landed, in landed:<old node> (member "<node>:<alloc
-- id>" of the new location, score the swap's time): a mover whose call and retry both failed asks
-- later whether its swap landed (LocalMoves._keep), and once the object was removed and its grave
-- freed, this is the only trace left. Trimmed at every write, and the key expires with the window.
local LANDED_KEEP_MS = 120000
local function defer(t, key, ...)
  local list = t[key]
  if not list then list = {}; t[key] = list end
  for _, v in ipairs({...}) do table.insert(list, v) end
end
local function write_swaps(swaps)
  for key in pairs(swaps.changed) do
    redis.call('HSET', P .. 'o:' .. key, 'replicas', encode_list(swaps.records[key].reps))
  end
  -- The tier sets follow each changed record's final replicas, so that two swaps of one key in a
  -- batch (host to disk, then back) leave it listed where it ends, whatever order the sets go in.
  for key, touched in pairs(swaps.tiers) do
    local reps = swaps.records[key].reps
    for _, nt in ipairs(touched) do
      defer(holds(reps, nt[1], nt[2]) and swaps.sadd or swaps.srem, tier_set(nt[1], nt[2]), key)
    end
  end
  for guard, there in pairs(swaps.guards) do
    if there then redis.call('DEL', P .. 'pend:' .. guard) end
  end
  for key, items in pairs(swaps.srem) do chunked('SREM', key, items) end
  for key, items in pairs(swaps.zadd) do chunked('ZADD', key, items) end
  for key, items in pairs(swaps.sadd) do chunked('SADD', key, items) end
  for key, items in pairs(swaps.rpush) do chunked('RPUSH', key, items) end
  for key, items in pairs(swaps.landed) do
    chunked('ZADD', key, items)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. (items[1] - LANDED_KEEP_MS))
    redis.call('PEXPIRE', key, LANDED_KEEP_MS)
  end
end
-- Whether the guard of a reservation (its pend: record) is still there ("" has none); write_swaps
-- deletes it, in the same atomic step as the swap.
local function take_guard(guard, swaps)
  if guard == '' then return true end
  local there = swaps.guards[guard]
  if there == nil then
    there = redis.call('EXISTS', P .. 'pend:' .. guard) == 1
    swaps.guards[guard] = there
  end
  return there
end
-- The record of key as a batch of swaps has it so far (read once; nil: no such object).
local function swap_record(key, swaps)
  local rec = swaps.records[key]
  if rec == nil then
    local f = redis.call('HMGET', P .. 'o:' .. key, 'replicas', 'lease_until')
    if not f[1] then return nil end
    local lease = tonumber(f[2] or 0)
    if lease == nil then error('o:' .. key .. ' lease_until is not a number: ' .. tostring(f[2])) end
    rec = {reps = record_replicas(key, f[1]), lease = lease}
    swaps.records[key] = rec
  end
  return rec
end
-- Why a new location may not be named (nil: it may): its reservation's guard is gone, it carries
-- another incarnation's tag, or its node is past its heartbeat deadline ("EXPIRED" for each).
-- Past its deadline the new node is skipped by readers and soon reaped: moving or copying the
-- object there would add a copy nobody can read.
local function target_refused(new, guard, now, swaps)
  if not take_guard(guard, swaps) then return 'EXPIRED' end
  if stale_alloc(new[1], new[5]) then return 'EXPIRED' end
  if not node_live(new[1], now) then return 'EXPIRED' end
  return nil
end
-- The checks a swap and a copy share: the new location is well formed and may be named, and the
-- object still holds the source replica (src_node, src_alloc), COMPLETE; the new node holds no other
-- replica (for a copy, nor is it the source's node). Returns the status that ends the plan ("OK"
-- where the new location is there already: a retry), or nil, the record and the source's index.
local function plan_checks(key, src_node, src_alloc, new, guard, now, swaps, copying)
  if not valid_replica(new) then return 'INVALID' end
  local rec = swap_record(key, swaps)
  if rec == nil then return 'GONE' end
  local found, dup = nil, copying and new[1] == src_node
  for i, r in ipairs(rec.reps) do
    if r[1] == new[1] and r[5] == new[5] then return 'OK' end
    if r[1] == src_node and r[5] == src_alloc and r[6] == 'COMPLETE' then found = i
    elseif r[1] == new[1] then dup = true end
  end
  local refused = target_refused(new, guard, now, swaps)
  if refused then return refused end
  if not found then return 'GONE' end
  if dup then return 'DUP' end
  return nil, rec, found
end
-- Compare-and-swap one replica of key from (old_node, old_alloc) to new (a decoded replica array)
-- (DESIGN.md §3.4), planned into swaps (new_swaps(); written by write_swaps). guard: "" or the put
-- id of the new location's reservation on another agent, whose record pend:<guard> that agent's
-- sync deletes when the reservation times out (one guard may cover a whole batch of reservations:
-- one expired, the batch's swaps are all refused). Returns "OK" (also for a retry whose first
-- call swapped: the caller must not free a copy the index names), "GONE", "PINNED", "EXPIRED" (the
-- guard is gone: the new location may already be freed; or the new node left the node table or
-- is past its heartbeat deadline) or "DUP" (the new node already holds another replica: two
-- copies on one node would be one), or "INVALID" (the new location is malformed).
local function plan_swap(key, old_node, old_alloc, new, guard, now, swaps, pinned_ok)
  local status, rec, found = plan_checks(key, old_node, old_alloc, new, guard, now, swaps, false)
  if status then return status end
  local reps = rec.reps
  -- Live pins, counted (lapsed ones are dropped by the scripts that write pins). A pinned object
  -- stays where it is, but for a promotion (pinned_ok) on its own node to a faster tier: the
  -- reader holding the pin is the one the promotion serves.
  if not pinned_ok and pins_running(key, now) > 0 then return 'PINNED' end
  new[6] = 'COMPLETE'
  defer(swaps.tiers, key, {reps[found][1], reps[found][2]}, {new[1], new[2]})
  reps[found] = new
  swaps.changed[key] = true
  -- A live read lease does not stop the move, where DESIGN.md §3.3 says it should (README, "Not
  -- built yet"): the old copy waits in the graveyard until the lease ends, so a reader under it
  -- reads whole bytes there, and readers from now on find the new location. Refusing it would
  -- stop every promotion (the read that offers one holds a lease) and waste a spilled batch's
  -- copies of objects read between the sample and the swap.
  defer(swaps.zadd, P .. 'gc:' .. old_node, math.max(now, rec.lease), old_alloc)
  local still_there = false
  for _, r in ipairs(reps) do if r[1] == old_node then still_there = true end end
  if not still_there then defer(swaps.srem, P .. 'nobj:' .. old_node, key) end
  defer(swaps.sadd, P .. 'nobj:' .. new[1], key)
  -- A chunk file that arrived from a peer: its agent learns the key with the ack (keys hold no
  -- control characters), so that a read can promote it to host memory.
  defer(swaps.rpush, P .. 'acks:' .. new[1], new[2] == 'disk' and (new[5] .. '\t' .. key) or new[5])
  defer(swaps.landed, P .. 'landed:' .. old_node, now, new[1] .. ':' .. new[5])
  return 'OK'
end

-- Add a replica of key at new (a decoded replica array), copied from (src_node, src_alloc), planned
-- into swaps (written by write_swaps): re-replication after a node's loss. The source stays. Returns
-- "OK" (also for a retry whose first call added it), "GONE" (the object no longer holds the source:
-- removed, replaced or moved meanwhile), "EXPIRED", "DUP" (the new node holds a replica already),
-- "WHOLE" (the object has its count of replicas already: the new copy is freed), or "INVALID",
-- with plan_swap's meanings. Pins do not matter: nothing of the object moves.
local function plan_copy(key, src_node, src_alloc, new, guard, now, swaps)
  local status, rec = plan_checks(key, src_node, src_alloc, new, guard, now, swaps, true)
  if status then return status end
  -- Whole already (another holder's copy landed first, or a late holder came back): one more
  -- would stay for good, since nothing trims replicas past the count.
  local copies = tonumber(redis.call('HGET', P .. 'o:' .. key, 'copies') or 0) or 0
  if counted_copies(rec.reps) >= copies then return 'WHOLE' end
  new[6] = 'COMPLETE'
  table.insert(rec.reps, new)
  swaps.changed[key] = true
  -- Whole again: off the source's list now, not when a later sample of it meets the key (that list
  -- is sampled a batch at a time, and done keys took the places of short ones).
  if counted_copies(rec.reps) >= copies then
    for _, r in ipairs(rec.reps) do defer(swaps.srem, P .. 'repair:' .. r[1], key) end
  end
  defer(swaps.tiers, key, {new[1], new[2]})
  defer(swaps.sadd, P .. 'nobj:' .. new[1], key)
  defer(swaps.rpush, P .. 'acks:' .. new[1], new[2] == 'disk' and (new[5] .. '\t' .. key) or new[5])
  return 'OK'
end

-- Drop one replica of key, (node, alloc), under memory pressure (evict.lua has the statuses).
-- `damaged`: its bytes failed their checksum (drop_corrupt.lua), so it goes whatever keeps a
-- victim (pins, a read lease, chunks hanging off it): no reader could get its bytes anyway. Its
-- memory is still freed only once the read leases run out; a loss is counted as "corrupt".
-- ``since`` (ms, optional): the time of the sample that chose the victim; an object accessed after
-- it (a read's lookup, a store's claim of a chunk it extends, a commit) is warm now: "TOUCHED".
-- An access in the very millisecond of the sample counts too: the clock's resolution cannot say
-- whether it came before or after, and a store that followed a sample within the millisecond had
-- its prompt cut back from its new leaves (the pass evicts such objects last, not never).
local function evict_replica(key, node, alloc, now, damaged, since)
  local ok = P .. 'o:' .. key
  local f = redis.call('HMGET', ok, 'replicas', 'lease_until', 'copies', 'last_access')
  if not f[1] then return 'GONE' end
  if not sound_record(f[1], f[2]) then return 'MALFORMED' end
  local keep, found = {}, nil
  for _, r in ipairs(record_replicas(key, f[1])) do
    if r[1] == node and r[5] == alloc then found = r else table.insert(keep, r) end
  end
  if not found then return 'GONE' end
  if not damaged and live_pins(key, now) > 0 then return 'PINNED' end
  -- The last readable copy: none left on a live node (a replica on a node past its deadline is
  -- skipped by readers and soon reaped, so it keeps neither the chain whole nor the object).
  local readable = 0
  for _, r in ipairs(keep) do
    if r[6] == 'COMPLETE' and node_live(r[1], now) then readable = readable + 1 end
  end
  if not damaged and readable == 0 and children_of(key) > 0 then return 'PARENT' end
  if not damaged and tonumber(f[2] or 0) > now then return 'LEASED' end
  if not damaged and since and (tonumber(f[4]) or 0) >= since then return 'TOUCHED' end
  redis.call('ZADD', P .. 'gc:' .. node, math.max(now, tonumber(f[2] or 0)), alloc)
  local still_there = false
  for _, r in ipairs(keep) do if r[1] == node then still_there = true end end
  if not still_there then redis.call('SREM', P .. 'nobj:' .. node, key) end
  if not holds(keep, node, found[2]) then redis.call('SREM', tier_set(node, found[2]), key) end
  local lost = damaged and 'corrupt' or 'evictions'
  if #keep == 0 then
    count_lost(ok, lost, {found}, {})
    drop_object(key)
  else
    redis.call('HSET', ok, 'replicas', encode_list(keep))
    -- What is left is on dead nodes only: the object is lost to readers now, which is an eviction.
    if readable == 0 then count_lost(ok, lost, {found}, keep) end
    -- A damaged replica is a loss like a dead node's, and so is a copy a full node dropped: the
    -- object is listed for re-replication from a sound copy. A dropped copy that listed nothing
    -- left `short` at 0 while the object had one copy, where the README's rolling restart waits
    -- for 0, and the next node's loss took the object. A dropped one is marked `thinned`: it is
    -- copied again only into room under a peer's low watermark, which no pressure pass takes back
    -- (into room under the high one, as a loss's copies go, the repair would put it back on the
    -- next node to fill, whose next pass would drop it again, while writers fill the cluster).
    -- Listed at this node (the holder a dead node's purge chose), it is listed at another holder
    -- now: left here too, `short` (the sum of the lists) counted it twice until this node's next
    -- repair call.
    local copies = tonumber(f[3] or 0) or 0
    if counted_copies(keep) < copies then
      if damaged then redis.call('HDEL', ok, 'thinned') else redis.call('HSET', ok, 'thinned', '1') end
    end
    if not still_there then redis.call('SREM', P .. 'repair:' .. node, key) end
    note_short(key, keep, copies, now)
  end
  return 'OK'
end
