-- move_replicas: compare-and-swap a batch of one node's replicas to new locations, each entry on its
-- own and with move_replica.lua's rules (DESIGN.md §3.4: copy, swap, then free), in one round trip.
-- KEYS: none
-- ARGV: [1] prefix, [2] old node, then four per entry: key, old alloc id, new replica JSON
--       [node, tier, offset, size, alloc_id, state], guard put id of the new location's
--       reservation ("" for none; entries may share one)
-- Returns: one status per entry, in order: "OK" the object now lists the new location and the old
--   one is in its agent's graveyard (freed once the object's read leases have run out); "GONE" the
--   object no longer holds the old location (removed, replaced or moved meanwhile: drop the new
--   copy); "PINNED" the object has live pins and must not move (drop the new copy); "EXPIRED" the
--   new location's agent already reclaimed its reservation (a slow copy): the guard record
--   pend:<put id> is gone, so the swap would name freed memory.
-- The guard is what the target agent's sync deletes when the reservation times out; deleting it
-- here, in the same atomic step as the swap, decides the race either way.
-- Each new location's agent is told through its ack list, exactly as for a commit.
-- Entries may share a guard (a spill batch has one): it is looked up once and deleted at the end,
-- and what the swaps write to node sets, graveyards and ack lists goes out once per key. Every
-- entry is checked before anything is written (prelude.lua: plan_swap, write_swaps).
local old_node = ARGV[2]
local now = now_ms()
local out = {}
local swaps = new_swaps()
for i = 3, #ARGV - 3, 4 do
  table.insert(out, plan_swap(ARGV[i], old_node, ARGV[i + 1], cjson.decode(ARGV[i + 2]), ARGV[i + 3], now, swaps))
end
write_swaps(swaps)  -- only once every entry is planned: a call that fails writes nothing
return out
