-- node_heartbeat: extend an agent's deadline and publish its current use.
-- KEYS: none
-- ARGV: [1] prefix, [2] node id, [3] incarnation, [4] ttl ms, [5] JSON of fields to merge into the node
-- record, [6] (optional) the count of heartbeats and syncs the agent was answered last, [7] (optional)
-- "1": the agent has reconciled with the index as it now is, whose count goes on from the higher
-- of its own and [6] (never back: a later restore of a snapshot from between the two, or from the
-- reconcile itself, is told apart too), [8] (optional) the agent's heartbeat interval in ms, by
-- which an outage of the index is told (prelude's heard_from_a_node)
-- Returns: {"OK", deadline_ms, beats}, {"BEHIND", beats} or {"UNKNOWN"} when the record is gone,
-- belongs to another incarnation or is being purged (the agent was reaped while stalled and must
-- register again).
-- beats counts this record's heartbeats and syncs (agent_sync.lua): an index restored from a
-- snapshot older than the last of them holds fewer than the agent was answered last, and may name
-- memory the agent has freed and used again since. Then the deadline is not extended but ended
-- ("BEHIND", the record's count): readers skip the node and commits naming it fail while its
-- agent brings the index in line with its tables (agent/takeover.py reconcile_after_rollback),
-- which its "reconciled" beat then ends. Extended at once, the node's stale replicas were readable
-- (another object's bytes, by memcpy) and a revived pending record could commit for the whole
-- reconcile.
local node, inc, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = now_ms()
local raw = redis.call('HGET', P .. 'nodes', node)
if not raw then return {'UNKNOWN'} end
-- Being reaped (or taken over): part of its replicas may be gone already.
if redis.call('SISMEMBER', P .. 'purging', node) == 1 then return {'UNKNOWN'} end
local rec = node_row(raw)
if not rec then
  -- A row no JSON decodes (written by hand, or by another build) names no incarnation, and no
  -- client reads the node through it (each leaves such a row out): the node's deadline is ended
  -- so that its agent, told UNKNOWN, registers again, purging what the row listed. Failing each
  -- beat instead, an agent alone in its cluster was never reaped (a reap after a silence of every
  -- beat takes it for the index's own outage: node_reap.lua) and stayed unreadable for good.
  redis.call('ZADD', P .. 'hb', 0, node)
  redis.call('ZADD', P .. 'reap', 0, node)
  return {'UNKNOWN'}
end
if rec.incarnation ~= inc then return {'UNKNOWN'} end
local interval = tonumber(ARGV[8] or '')
heard_from_a_node(now, ttl, interval and 2 * interval)
local last = tonumber(ARGV[6] or '')
local reconciled = ARGV[7] == '1'
if last ~= nil and not reconciled and (tonumber(rec.beats) or 0) < last then
  -- Unreadable, yet held: no agent of another incarnation takes the node id meanwhile
  -- (node_register.lua), as none may while the deadline runs.
  rec.reconciling_until = now + 2 * ttl
  redis.call('HSET', P .. 'nodes', node, cjson.encode(rec))
  redis.call('ZADD', P .. 'hb', now - 1, node)
  -- Not reaped while it reconciles: its own TTL past now, as a beat gives it.
  redis.call('ZADD', P .. 'reap', now + 2 * ttl, node)
  return {'BEHIND', tonumber(rec.beats) or 0}
end
for k, v in pairs(cjson.decode(ARGV[5])) do rec[k] = v end
rec.last_heartbeat_ms = now
rec.reconciling_until = nil
rec.beats = (tonumber(rec.beats) or 0) + 1
if reconciled and last ~= nil and rec.beats <= last then rec.beats = last + 1 end
redis.call('HSET', P .. 'nodes', node, cjson.encode(rec))
redis.call('ZADD', P .. 'hb', now + ttl, node)
redis.call('ZADD', P .. 'reap', now + 2 * ttl, node)  -- its own TTL past its deadline (node_reap.lua)
return {'OK', now + ttl, rec.beats}
