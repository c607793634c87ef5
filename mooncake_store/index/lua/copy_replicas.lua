-- copy_replicas: add replicas copied from one node's, to restore objects' replica counts after a
-- node's loss (re-replication), each entry on its own and in one round trip.
-- KEYS: none
-- ARGV: [1] prefix, [2] source node, then four per entry: key, source alloc id, new replica JSON
--       [node, tier, offset, size, alloc_id, state], guard put id of the new location's
--       reservation ("" for none; entries may share one)
-- Returns: one status per entry, in order (prelude.lua: plan_copy): "OK" the object lists the new
--   replica as well; "GONE" it no longer holds the source (drop the new copy); "EXPIRED" the guard
--   or the new node is gone; "DUP" the new node already holds a replica; "WHOLE" the object has
--   its count of replicas already (drop the new copy); "INVALID".
-- The new location's agent is told through its ack list, as for a commit. Every entry is checked
-- before anything is written, as in move_replicas.lua.
local src_node = ARGV[2]
local now = now_ms()
local out = {}
local swaps = new_swaps()
for i = 3, #ARGV - 3, 4 do
  table.insert(out, plan_copy(ARGV[i], src_node, ARGV[i + 1], cjson.decode(ARGV[i + 2]), ARGV[i + 3], now, swaps))
end
write_swaps(swaps)
return out
