-- node_lease.lua: renew (or give up) a worker node's lease; read every node's.
--
-- KEYS[1] leases (ZSET node id -> lease end, server ms)
-- ARGV[1] node id   ARGV[2] lease ms (0: leave: the caller's lease is dropped)
-- ARGV[3] renewal period ms: leases end on its multiples plus the lease (0: now + lease)
-- ARGV[4...] nodes whose lease lapsed and whose shard entries the caller forgot: dropped
--            from the set if their lease is still lapsed
--
-- One lease per node stands for every shard it leads (acquire.lua): a node renews it
-- with one call per period whatever the number of shards, and standbys read here when
-- a leader's lease ends. Renewed at the start of a period, every node's lease ends at
-- the same instant (the period's start plus the lease), so one look just after it
-- sees every node that failed to renew. The key has a hash tag of its own; on a Redis
-- Cluster it is one call to one master.
-- Returns {now, 1 if the caller's lease had lapsed (or was never taken) else 0,
--          {NODE, LEASE-END, ...} of every node, lapsed ones included}.

local node, lease, period, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), now_ms()
local before = tonumber(redis.call('ZSCORE', KEYS[1], node))
local lapsed = (not before or before < now) and 1 or 0
if lease > 0 then
  local ends = now + lease
  if period > 0 then ends = math.max(before or 0, now - now % period + lease) end
  redis.call('ZADD', KEYS[1], ends, node)
else
  redis.call('ZREM', KEYS[1], node)
end
for i = 4, #ARGV do
  local ends = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i]))
  if ends and ends < now then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return {now, lapsed, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')}
