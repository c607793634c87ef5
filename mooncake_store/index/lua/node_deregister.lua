-- node_deregister: an agent leaves; its memory goes with it, so its replicas leave the index too.
-- KEYS: none
-- ARGV: [1] prefix, [2] node id, [3] incarnation, [4] max keys per call
-- Returns: keys still to purge (call again while > 0), or -1 if another incarnation owns the id.
local node, inc = ARGV[2], ARGV[3]
local raw = redis.call('HGET', P .. 'nodes', node)
-- A row no JSON decodes names no incarnation: not this agent's to purge (the reaper does, once
-- it is past its deadline).
if raw and (node_row(raw) or {}).incarnation ~= inc then return -1 end
redis.call('ZADD', P .. 'hb', 0, node)  -- unreadable at once, even while the purge is still running
redis.call('ZADD', P .. 'reap', 0, node)
return purge_node(node, tonumber(ARGV[4]))
