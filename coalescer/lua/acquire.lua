-- acquire.lua: take or keep a shard's leader lease.
--
-- KEYS[1] leader   KEYS[2] epoch   KEYS[3] nodes
-- ARGV[1] node id   ARGV[2] lease ms   ARGV[3] the caller's current leader
--         value "EPOCH|NODE-ID", or "" when it holds none
--
-- A free lease is granted with SET NX PX under a new epoch (INCR: it grows
-- with every grant). The holder's own value renews it. Anyone else is told
-- who holds it and for how long.
-- Returns {epoch granted or 0, holder value or "", lease ms left, live nodes}.

local node, lease, mine = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local live = heartbeat(KEYS[3], node, now_ms(), 2 * lease)
local holder = redis.call('GET', KEYS[1])
if not holder then
  local epoch = redis.call('INCR', KEYS[2])
  local value = int(epoch) .. '|' .. node
  redis.call('SET', KEYS[1], value, 'NX', 'PX', lease)
  return {epoch, value, lease, live}
end
if holder == mine and mine ~= '' then
  redis.call('PEXPIRE', KEYS[1], lease)
  return {tonumber(split(holder, 2)[1]), holder, lease, live}
end
return {0, holder, redis.call('PTTL', KEYS[1]), live}
