-- node_register: add an agent to the node table, or take over the record of a dead incarnation.
-- KEYS: none
-- ARGV: [1] prefix, [2] node id, [3] node JSON (must hold "incarnation"), [4] heartbeat ttl in ms,
--       [5] (optional) the count of heartbeats and syncs the record starts from (node_heartbeat.lua)
-- Returns: {"OK", deadline_ms, held, purged}, {"IN_USE", other_incarnation_json, held until ms,
-- now_ms} when a live agent holds the id (its deadline runs, or it reconciles after the index went
-- back), or {"PURGING", keys_left}: call again. held: {alloc id, ms left, ...} for the replicas a
-- purge of this node took from the index while read leases on them still run (an agent reaped while
-- it stalled keeps their memory that long). The replicas of an earlier, dead incarnation point into
-- memory that no longer exists, so they are purged first, in bounded steps; until the last step the
-- node stays past its deadline, so no reader takes an old replica for one in the new arena.
-- purged: 1 when a purge removed the node's last record (held is then complete), 0 when nothing
-- did: a first registration, or an index that lost its data and the leases it granted.
local node, info, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = now_ms()
local old = redis.call('HGET', P .. 'nodes', node)
if old then
  local d = tonumber(redis.call('ZSCORE', P .. 'hb', node) or 0)
  local inc = cjson.decode(info).incarnation
  -- A row no JSON decodes (written by hand, or by another build) is held while its deadline runs,
  -- as any holder's, and then purged and replaced like a dead incarnation's.
  local old_rec = node_row(old) or {}
  -- A node whose agent reconciles after the index went back is unreadable but held
  -- (node_heartbeat.lua): its deadline is ended, its reconcile's is not.
  local held_until = math.max(d, tonumber(old_rec.reconciling_until) or 0)
  if held_until >= now and old_rec.incarnation ~= inc then
    return {'IN_USE', old, tostring(held_until), tostring(now)}
  end
  local left = purge_node(node, 5000)  -- as reap and deregister: ~0.1 s of the server per call
  if left > 0 then
    redis.call('ZADD', P .. 'hb', 0, node)
    redis.call('ZADD', P .. 'reap', 0, node)
    return {'PURGING', left}
  end
end
local rec = cjson.decode(info)
if not old or (node_row(old) or {}).incarnation ~= rec.incarnation then
  -- A new incarnation starts counting afresh, like every other counter of its tiers.
  for _, t in ipairs(TIER_NAMES) do redis.call('HDEL', P .. 'stats', 'hits:' .. node .. ':' .. t) end
end
rec.last_heartbeat_ms = now
rec.beats = tonumber(ARGV[5] or '') or 0
heard_from_a_node(now, ttl, 0)
redis.call('HSET', P .. 'nodes', node, cjson.encode(rec))
redis.call('ZADD', P .. 'hb', now + ttl, node)
redis.call('ZADD', P .. 'reap', now + 2 * ttl, node)  -- its own TTL past its deadline (node_reap.lua)
local held = {}
local rows = redis.call('ZRANGEBYSCORE', P .. 'held:' .. node, '(' .. now, '+inf', 'WITHSCORES')
for i = 1, #rows, 2 do
  table.insert(held, rows[i])
  table.insert(held, tostring(tonumber(rows[i + 1]) - now))
end
local mark = redis.call('GET', P .. 'purged:' .. node)
local purged = mark and 1 or 0
redis.call('DEL', P .. 'purged:' .. node)
-- The same incarnation back after a reap (it stalled past its TTL) keeps counting its hits from
-- its start, as its uptime and its own counters do: the purge kept them in its mark (a mark of
-- an older build is "1", and gives nothing back).
local ok, kept = pcall(cjson.decode, mark or '')
if ok and type(kept) == 'table' and kept.incarnation == rec.incarnation and type(kept.hits) == 'table' then
  for _, tier in ipairs(TIER_NAMES) do
    local n = tonumber(kept.hits[tier]) or 0
    if n > 0 then redis.call('HINCRBY', P .. 'stats', 'hits:' .. node .. ':' .. tier, n) end
  end
end
return {'OK', now + ttl, held, purged}
