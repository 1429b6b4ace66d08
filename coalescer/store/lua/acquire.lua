-- acquire.lua: take or keep a shard's leader lease; register the caller's rules.
--
-- KEYS[1] leader   KEYS[2] epoch   KEYS[3] nodes   KEYS[4] rules   KEYS[5] rulenames
-- ARGV[1] node id   ARGV[2] lease ms   ARGV[3] the caller's current leader
--         value "EPOCH|NODE-ID", or "" when it holds none
-- ARGV[4] the rules the caller knows, "|NAME=FP|NAME=FP|" ("" registers nothing)
--
-- A free lease is granted with SET NX PX under a new epoch (INCR: it grows
-- with every grant). The holder's own value renews it. Anyone else is told
-- who holds it and for how long, and which of its rules the holder lacks and
-- it should serve beside the holder (adopt.lua): those whose lowest-id knower
-- among the live nodes it is.
-- Returns {epoch granted or 0, holder value or "", lease ms left, live nodes,
--          names of the rules to adopt (empty unless refused)}.

local node, lease, mine, known = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local live = heartbeat(KEYS[3], node, now_ms(), 2 * lease)
if known ~= '' then
  redis.call('HSET', KEYS[4], node, known)
  for name in string.gmatch(known, '|([^|=]+)=') do redis.call('SADD', KEYS[5], name) end
end
prune_rules(KEYS[4], KEYS[3])
local holder = redis.call('GET', KEYS[1])
if not holder then
  local epoch = redis.call('INCR', KEYS[2])
  local value = int(epoch) .. '|' .. node
  redis.call('SET', KEYS[1], value, 'NX', 'PX', lease)
  return {epoch, value, lease, live, {}}
end
if holder == mine and mine ~= '' then
  redis.call('PEXPIRE', KEYS[1], lease)
  return {tonumber(split(holder, 2)[1]), holder, lease, live, {}}
end
local adopt, holder_node = {}, split(holder, 2)[2]
for name in string.gmatch(known, '|([^|=]+)=') do
  if adopter_of(KEYS[4], KEYS[3], holder_node, name) == node then adopt[#adopt + 1] = name end
end
return {0, holder, redis.call('PTTL', KEYS[1]), live, adopt}
