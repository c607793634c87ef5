-- agent_sync: one round trip in which an agent learns what happened to its memory.
-- KEYS: none
-- ARGV: [1] prefix, [2] node id, [3] max graveyard entries, [4] "1" if the agent applied the last
--       reply it received (and received the last one it asked for), else "0", [5] the agent's
--       incarnation, [6] the count of heartbeats and syncs the agent was answered last ("" for
--       none), [7..n] put ids of reservations past their deadline
-- Returns: {acks, statuses, graves, count}, {"SUPERSEDED"} when the node record is not this
-- incarnation's (reaped, or taken over by a new agent under the same id): what waits in the ack
-- list and the graveyard belongs to the record's incarnation, and must not be drained by this one;
-- or {"BEHIND", count} when the record counts fewer heartbeats and syncs than the agent was
-- answered last: the index was restored from an older snapshot, and nothing is drained (the
-- agent's next heartbeat ends the node's deadline while it reconciles: node_heartbeat.lua).
-- Each sync counts, as each heartbeat does: frees follow syncs, and a snapshot taken after the
-- last heartbeat but before a sync whose revokes and graves the agent then freed is told apart at
-- the next sync, not missed for good.
--   acks:     alloc ids committed since the last confirmed sync; a move onto this agent's disk tier
--             lists "<alloc id>\t<key>"
--   statuses: one per expired put id: "R" the pending record was still there and is now revoked
--             (free the space: a later commit fails with EXPIRED), "G" it was already gone
--             (committed, and then listed in acks, or revoked by its writer)
--   graves:   alloc ids whose objects were removed or replaced and whose leases have run out (free them)
-- Acks and graves are delivered at least once: what a reply carries stays in acksout:/gcout: until
-- the agent's next sync says it applied that reply. A reply lost on the way (the agent's call timed
-- out while this script still ran, in a stall of the server) is carried again by the next one;
-- dropped, its acks would let the agent free objects that the index names, its graves would leak.
-- Applying an ack or a grave twice is harmless: alloc ids are never reused.
local node = ARGV[2]
local now = now_ms()
local record = redis.call('HGET', P .. 'nodes', node)
if not record then return {'SUPERSEDED'} end
local rec = node_row(record)
if not rec then
  -- No JSON (written by hand, or by another build): its next heartbeat ends the node's deadline
  -- and the agent registers again (node_heartbeat.lua).
  error('malformed node record ' .. node .. ' in the index (written by hand or by another build): '
    .. string.sub(record, 1, 80) .. '; its agent registers again at its next heartbeat', 0)
end
if rec.incarnation ~= ARGV[5] then return {'SUPERSEDED'} end
-- Being purged (reaped, and its agent registering again): what the record lists goes, and the
-- count the registration writes is not this one's.
if redis.call('SISMEMBER', P .. 'purging', node) == 1 then return {'SUPERSEDED'} end
local count = tonumber(rec.beats) or 0
local last = tonumber(ARGV[6])
if last ~= nil and count < last then return {'BEHIND', count} end
rec.beats = count + 1
redis.call('HSET', P .. 'nodes', node, cjson.encode(rec))
local ak, gk = P .. 'acks:' .. node, P .. 'gc:' .. node
local ako, gko = P .. 'acksout:' .. node, P .. 'gcout:' .. node
if ARGV[4] == '1' then redis.call('DEL', ako, gko) end

local function append(dst, items) chunked('RPUSH', dst, items) end

append(ako, redis.call('LRANGE', ak, 0, -1))
redis.call('DEL', ak)
local statuses = {}
for i = 7, #ARGV do
  if redis.call('DEL', P .. 'pend:' .. ARGV[i]) == 1 then
    table.insert(statuses, 'R')
  else
    table.insert(statuses, 'G')
  end
end
local room = tonumber(ARGV[3]) - redis.call('LLEN', gko)
if room > 0 then
  local due = redis.call('ZRANGEBYSCORE', gk, '-inf', now, 'LIMIT', 0, room)
  chunked('ZREM', gk, due)
  append(gko, due)
end
return {redis.call('LRANGE', ako, 0, -1), statuses, redis.call('LRANGE', gko, 0, -1), rec.beats}
