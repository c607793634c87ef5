-- put_start: record PENDING replicas for a batch of puts (phase one of the two-phase put).
-- KEYS: none (all keys derive from the prefix)
-- ARGV: [1] prefix, [2] reservation ttl in ms, [3] JSON array of entries
--       {put_id, key, size, dtype, shape, checksum, replicas=[[node,tier,offset,size,alloc,"PENDING"],...],
--        chain_pos, chain_parent (optional: position in a prefix chain and the key of the chunk
--        before it; eviction takes only chunks with no stored children, coldest and latest first)}
-- Returns: number of pending records written. A pending record is invisible to readers; it either
-- becomes the object in put_commit, or is dropped by put_revoke or by its agent's reclaim.
local ttl = tonumber(ARGV[2])
local entries = cjson.decode(ARGV[3])
local now = now_ms()
-- All or nothing: every entry is checked before the first is written.
for i, e in ipairs(entries) do
  if not valid_entry(e) then return redis.error_reply('BAD_ENTRY put_start entry ' .. i .. ' is malformed') end
end
for _, e in ipairs(entries) do
  local pk = P .. 'pend:' .. e.put_id
  redis.call('HSET', pk, 'key', e.key, 'entry', cjson.encode(e), 'deadline', now + ttl)
  -- A safety net only: agents reclaim by their own deadline; this keeps crashed puts from piling up.
  redis.call('PEXPIRE', pk, ttl * 4 + 60000)
end
return #entries
