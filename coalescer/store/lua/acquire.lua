#!lua flags=allow-oom
-- acquire.lua: take or keep a shard's leadership; register the caller's rules.
--
-- KEYS[1] leader   KEYS[2] epoch   KEYS[3] nodes   KEYS[4] rules   KEYS[5] rulenames
-- ARGV[1] node id   ARGV[2] unused (leases are per node: node_lease.lua)
-- ARGV[3] the caller's current leader value "EPOCH|NODE-ID", or "" when it holds none
-- ARGV[4] the rules the caller knows, "|NAME=FP|NAME=FP|" ("" registers nothing)
-- ARGV[5] a holder value to take over: the caller saw that holder's node lease lapse
--         ("" for none)
-- ARGV[6] the shard's wake channel
--
-- The leader key holds "EPOCH|NODE-ID" with no expiry: it counts while that node's lease
-- (node_lease.lua, one per node whatever the number of shards) lives, so a leader
-- renews nothing per shard. The key is granted under a new epoch (INCR: it grows with
-- every grant) when it is free, when it still holds exactly the value of ARGV[5] (a
-- compare-and-set: a standby takes over from a node whose lease it saw lapse; should
-- that node come back, its next claim finds another value and stops), or when it names
-- the caller's own node id with another value (an earlier run of this node id). The
-- holder's own value keeps it. A take-over is announced on the wake channel ("taken"),
-- so an old holder still alive stops claiming at once. Anyone else is told who holds
-- it, and which of its rules the holder lacks and it should serve beside the holder
-- (adopt.lua): those whose lowest-id knower among the live nodes it is.
-- Returns {epoch granted or 0, holder value or "", 0 (formerly the lease left),
--          nodes in the shard's node set, names of the rules to adopt (empty unless
--          refused)}.

local node, mine, known, take_from = ARGV[1], ARGV[3], ARGV[4], ARGV[5]
local live = heartbeat(KEYS[3], node, now_ms())
if known ~= '' then
  redis.call('HSET', KEYS[4], node, known)
  for name in string.gmatch(known, '|([^|=]+)=') do redis.call('SADD', KEYS[5], name) end
end
prune_rules(KEYS[4], KEYS[3])
local holder = redis.call('GET', KEYS[1])
if holder and holder == mine then
  return {tonumber(split(holder, 2)[1]), holder, 0, live, {}}
end
local holder_node = holder and split(holder, 2)[2]
if not holder or holder == take_from or holder_node == node then
  local epoch = redis.call('INCR', KEYS[2])
  local value = int(epoch) .. '|' .. node
  redis.call('SET', KEYS[1], value)
  if holder then redis.call('PUBLISH', ARGV[6], 'taken') end
  return {epoch, value, 0, live, {}}
end
local adopt = {}
for name in string.gmatch(known, '|([^|=]+)=') do
  if adopter_of(KEYS[4], KEYS[3], holder_node, name) == node then adopt[#adopt + 1] = name end
end
return {0, holder, 0, live, adopt}
