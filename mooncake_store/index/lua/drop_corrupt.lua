-- drop_corrupt: drop a replica whose bytes failed their checksum on its node (a damaged chunk
-- file), whatever keeps a victim under pressure (pins, a read lease, chunks hanging off it): a
-- reader could only fail on it, again and again, while the index listed it. Readers then find
-- the object's other replicas, or no object (counted in stats as corrupt, not as an eviction).
-- Its memory is freed through the node's graveyard once the read leases on it run out.
-- KEYS: none
-- ARGV: [1] prefix, [2] node, [3] key, [4] alloc id
-- Returns: "OK", or "GONE" (the object no longer lists that replica).
return evict_replica(ARGV[3], ARGV[2], ARGV[4], now_ms(), true)
