-- move_replica: compare-and-swap one replica's location (DESIGN.md §3.4: copy, swap, then free).
-- KEYS: none
-- ARGV: [1] prefix, [2] key, [3] old node, [4] old alloc id, [5] new replica JSON
--       [node, tier, offset, size, alloc_id, state], [6] "1" for a promotion to a faster tier of
--       the same node, which live pins do not hold back (optional)
-- Returns: "OK" the object now lists the new location and the old one is in its agent's graveyard
--   (freed once the object's read leases have run out); "GONE" the object no longer holds the old
--   location (removed, replaced or moved meanwhile: drop the new copy); "PINNED" the object has
--   live pins and must not move (drop the new copy; never for a promotion).
-- The new location's agent is told through its ack list, exactly as for a commit.
local swaps = new_swaps()
local new = cjson.decode(ARGV[5])
local promoting = ARGV[6] == '1' and type(new) == 'table' and new[1] == ARGV[3]
local status = plan_swap(ARGV[2], ARGV[3], ARGV[4], new, '', now_ms(), swaps, promoting)
write_swaps(swaps)
return status
