-- agent_sync: one round trip in which an agent learns what happened to its memory.
-- KEYS: none
-- ARGV: [1] prefix, [2] node id, [3] max graveyard entries, [4..n] put ids of reservations past
--       their deadline
-- Returns: {acks, statuses, graves}
--   acks:     alloc ids committed since the last sync (drained); a move onto this agent's disk
--             tier lists "<alloc id>\t<key>"
--   statuses: one per expired put id: "R" the pending record was still there and is now revoked
--             (free the space: a later commit fails with EXPIRED), "G" it was already gone
--             (committed, and then listed in acks, or revoked by its writer)
--   graves:   alloc ids whose objects were removed or replaced and whose leases have run out (free them)
local node = ARGV[2]
local now = now_ms()
local ak = P .. 'acks:' .. node
local acks = redis.call('LRANGE', ak, 0, -1)
redis.call('DEL', ak)
local statuses = {}
for i = 4, #ARGV do
  if redis.call('DEL', P .. 'pend:' .. ARGV[i]) == 1 then
    table.insert(statuses, 'R')
  else
    table.insert(statuses, 'G')
  end
end
local gk = P .. 'gc:' .. node
local graves = redis.call('ZRANGEBYSCORE', gk, '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
if #graves > 0 then redis.call('ZREM', gk, unpack(graves)) end
return {acks, statuses, graves}
