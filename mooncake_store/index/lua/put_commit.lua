-- put_commit: make a batch of pending puts visible, each atomically (phase two).
-- KEYS: none
-- ARGV: [1] prefix, [2..n] put ids, each as "<put id>" or "<put id>=<checksum>" (decimal u64: the
-- checksum of the bytes as they landed, which replaces the pending entry's)
-- Returns: one status per put id, in order: "OK", "EXPIRED" (the pending record is gone: revoked or
-- reclaimed, the bytes may already be freed), "GONE" (a replica's node has left the node table, is
-- past its heartbeat deadline, or restarted since the reservation: an index restarted empty forgets
-- every node until its next heartbeat, so a writer may wait for the table and try again; clients
-- of earlier builds read it as any status but OK, a failed put), "PINNED" (the key exists and
-- holds live pins, so it cannot be replaced), "LOOP" (its chain link is out of order: see
-- out_of_order below; the order is what keeps chains from looping), "MALFORMED" (the record under
-- the key has a replica list or a lease_until this build cannot read) or "BAD_COUNT" (a chain parent's child count
-- is no integer): both written by hand or by another build, left as they are.
-- On OK an older object under the key is replaced in one step: its replicas go to their agents'
-- graveyards, to be freed once every read lease granted on it has expired.
local now = now_ms()
local out = {}
-- Chain positions grow along every parent link, so no chain can loop (each chunk of a loop would
-- count a stored child and never be evicted). A link is out of order when its parent is the key
-- itself, when the entry has no position, when its parent is stored at a position not before the
-- entry's, or when a chunk committed as the key's child sits at a position not after the entry's
-- (minchild). Two HGETs per chained entry, whatever the chain's length.
local function out_of_order(e)
  local parent = e.chain_parent
  if not parent or parent == '' then return false end
  local pos = tonumber(e.chain_pos)
  if pos == nil or parent == e.key then return true end
  local parent_pos = tonumber(redis.call('HGET', P .. 'o:' .. parent, 'chain_pos'))
  if parent_pos ~= nil and parent_pos >= pos then return true end
  local lowest_child = tonumber(redis.call('HGET', P .. 'minchild', e.key))
  return lowest_child ~= nil and lowest_child <= pos
end
-- All or nothing: every argument is checked before the first put is committed.
local ids, sums = {}, {}
for i = 2, #ARGV do
  local id, sum = string.match(ARGV[i], '^([^=]+)=(.*)$')
  if id == nil then
    id = ARGV[i]
  elseif not is_digits(sum) or #sum > 20 then
    return redis.error_reply('BAD_ENTRY put_commit argument ' .. (i - 1) .. ' has a malformed checksum')
  end
  ids[i - 1], sums[i - 1] = id, sum
end
for i, put_id in ipairs(ids) do
  local pk = P .. 'pend:' .. put_id
  local raw = redis.call('HGET', pk, 'entry')
  if not raw then
    table.insert(out, 'EXPIRED')
  else
    local e = cjson.decode(raw)
    if sums[i] then e.checksum = sums[i] end
    local ok = P .. 'o:' .. e.key
    local old = record_fields(ok, 'replicas', 'lease_until', 'chain_parent')
    local wrong_type = old == nil
    old = old or {}
    -- A replica on a node that left the node table (reaped, deregistered), or reserved from an
    -- earlier incarnation of its node (restarted since), names memory that is gone; no reaper would
    -- ever find it again, so the put fails like an expired reservation.
    -- A replica on a node past its heartbeat deadline would be skipped by every reader and soon
    -- reaped: reported stored, the object would be unreadable at once (or short of a replica).
    local orphan = false
    for _, r in ipairs(e.replicas) do
      if stale_alloc(r[1], r[5]) or not node_live(r[1], now) then orphan = true end
    end
    if orphan then
      redis.call('DEL', pk)
      table.insert(out, 'GONE')
    elseif wrong_type then
      table.insert(out, 'MALFORMED')  -- the key holds no hash: left as it is
    elseif old[1] and live_pins(e.key, now) > 0 then
      table.insert(out, 'PINNED')
    elseif out_of_order(e) then
      table.insert(out, 'LOOP')
    elseif old[1] and not sound_record(old[1], old[2]) then
      -- What can fail (a record or a counter not of its type) is refused before the entry's first
      -- write, as a status of its own: Redis keeps the writes a script made before an error, and a
      -- commit that buried the old replicas and then failed left the record naming freed memory
      -- (reads of another object's bytes once it was reused) and the new allocations acked for
      -- nothing; an error also cut the batch short after the entries before it had committed.
      table.insert(out, 'MALFORMED')
    elseif (old[3] or '') ~= (e.chain_parent or '') and not (children_ok(old[3]) and children_ok(e.chain_parent)) then
      table.insert(out, 'BAD_COUNT')
    else
      local old_replicas = old[1] and well_formed_replicas(old[1])
      local new_parent = e.chain_parent or ''
      local version = redis.call('INCR', P .. 'version')
      if old_replicas then
        local free_at = math.max(now, tonumber(old[2] or 0))
        bury(old_replicas, e.key, free_at)
      end
      for _, r in ipairs(e.replicas) do
        r[6] = 'COMPLETE'
        redis.call('SADD', P .. 'nobj:' .. r[1], e.key)
        redis.call('SADD', tier_set(r[1], r[2]), e.key)
        redis.call('RPUSH', P .. 'acks:' .. r[1], r[5])
      end
      redis.call('HSET', ok, 'size', e.size, 'dtype', e.dtype, 'shape', e.shape,
        'checksum', e.checksum, 'version', version, 'replicas', encode_list(e.replicas),
        'lease_until', 0, 'last_access', now, 'created', now, 'copies', #e.replicas)
      if e.chain_pos then
        redis.call('HSET', ok, 'chain_pos', e.chain_pos)
        -- A new object: its loss is counted anew (count_lost), and no copy of it was dropped.
        redis.call('HDEL', ok, 'lost', 'thinned')
      else
        redis.call('HDEL', ok, 'chain_pos', 'lost', 'thinned')
      end
      -- Children hang off the key, not the object: a replaced object keeps them. The parent link is
      -- the new object's.
      if (old[3] or '') ~= new_parent then
        adjust_children(old[3], e.key, -1)
        adjust_children(new_parent, e.key, 1)
      end
      if new_parent ~= '' then
        redis.call('HSET', ok, 'chain_parent', new_parent)
        local lowest = tonumber(redis.call('HGET', P .. 'minchild', new_parent))
        if lowest == nil or tonumber(e.chain_pos) < lowest then
          redis.call('HSET', P .. 'minchild', new_parent, e.chain_pos)
        end
      else
        redis.call('HDEL', ok, 'chain_parent')
      end
      redis.call('SADD', P .. 'keys', e.key)
      redis.call('DEL', pk)
      table.insert(out, 'OK')
    end
  end
end
return out
