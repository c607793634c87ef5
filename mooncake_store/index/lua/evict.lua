-- evict: drop replicas of a node under memory pressure (this is a cache), a batch in one round
-- trip, each entry on its own and in order (a chain's leaf evicted earlier in the batch lets its
-- parent go later in the same batch).
-- KEYS: none
-- ARGV: [1] prefix, [2] node, [3] the time (ms) of the sample that chose the victims, "" for none,
--       then two per entry: key, alloc id
-- Returns: one status per entry, in order: "OK" (the replica is in its agent's graveyard; if it
-- was the last one the object is gone and counted in stats.evictions), "GONE" (no such replica any
-- more), "PINNED", "LEASED" (a reader looked it up since the sample that chose it: it is hot, and
-- a read lease is live), "TOUCHED" (accessed since the sample, ARGV[3]: a read whose lease has
-- run out, a store's claim of a chunk it extends, or a put committed since), "PARENT" (its last
-- replica, and stored chunks of its prefix chain hang off it: the sample that chose it was
-- stale), or "MALFORMED" (a record this build cannot read: left as it is).
local node = ARGV[2]
local since = tonumber(ARGV[3])
local now = now_ms()
local out = {}
for i = 4, #ARGV - 1, 2 do
  table.insert(out, evict_replica(ARGV[i], node, ARGV[i + 1], now, false, since))
end
return out
