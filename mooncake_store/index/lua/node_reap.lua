-- node_reap: purge nodes whose heartbeat deadline passed more than their grace ago.
-- KEYS: none
-- ARGV: [1] prefix, [2] "" to reap each node once its own grace is over (the `reap` zset: its
-- deadline plus its own heartbeat TTL, so agents with different TTLs may share a cluster), or a
-- grace in ms for every node, [3] max keys per call, [4] the grace of a node whose agent records no
-- reap time (an older version), [5] the caller's id, [6] ms of a reaper's turn: while one runs, no
-- other reaps (0: no turn), so that every agent's reap of a large dead node does not queue up here
-- Returns: the ids of the nodes purged completely in this call. Readers already skip such nodes
-- (lookup checks the deadline); reaping only removes their records.
local now = now_ms()
local budget = tonumber(ARGV[3])
local forced = tonumber(ARGV[2])
local due
if forced then
  due = redis.call('ZRANGEBYSCORE', P .. 'hb', '-inf', '(' .. (now - forced), 'LIMIT', 0, 16)
else
  -- Agents reap right after a heartbeat of their own. When no heartbeat of any node landed for
  -- longer than the caller's TTL, this call waited out an outage of the index itself (sent as
  -- it stalled, run when it came back) and every node looks overdue: the next heartbeat gives
  -- each its grace again (node_heartbeat.lua), and the next reap looks.
  local last = tonumber(redis.call('GET', P .. 'hb_last') or '0')
  if last > 0 and now - last > tonumber(ARGV[4]) then return {} end
  due = {}
  for _, node in ipairs(redis.call('ZRANGEBYSCORE', P .. 'reap', '-inf', '(' .. now, 'LIMIT', 0, 16)) do
    -- Sent before an outage shorter than the caller's TTL and run after it, before any heartbeat:
    -- a node whose grace the silence passed missed its deadline in it, and the next heartbeat to
    -- land gives it its grace again (prelude's heard_from_a_node). Right after the caller's own
    -- beat, as agents reap, there is no silence and this skips nothing.
    local deadline = tonumber(redis.call('ZSCORE', P .. 'hb', node) or '0')
    local grace = tonumber(redis.call('ZSCORE', P .. 'reap', node)) - deadline
    if not (last > 0 and deadline > 0 and grace > 0 and now - last > grace) then table.insert(due, node) end
  end
  if #due < 16 then
    local older = redis.call('ZRANGEBYSCORE', P .. 'hb', '-inf', '(' .. (now - tonumber(ARGV[4])), 'LIMIT', 0, 64)
    for _, node in ipairs(older) do
      if not redis.call('ZSCORE', P .. 'reap', node) then table.insert(due, node) end
    end
  end
  local turn = tonumber(ARGV[6])
  if #due == 0 then return {} end
  if turn > 0 and not redis.call('SET', P .. 'reaper', ARGV[5], 'NX', 'PX', turn) then return {} end
end
local done = {}
for _, node in ipairs(due) do
  if budget <= 0 then break end
  local n = redis.call('SCARD', P .. 'nobj:' .. node)
  if purge_node(node, budget) == 0 then table.insert(done, node) end
  budget = budget - n
end
return done
