-- node_lease.lua: renew (or give up) a worker node's lease; read every node's.
--
-- KEYS[1] leases (ZSET node id -> lease end, server ms)
-- ARGV[1] node id   ARGV[2] lease ms (0: leave: the caller's lease is dropped)
-- ARGV[3...] nodes whose lease lapsed and whose shard entries the caller forgot: dropped
--            from the set if their lease is still lapsed
--
-- One lease per node stands for every shard it leads (acquire.lua): a node renews it
-- with one call per period whatever the number of shards, and standbys read here when
-- a leader's lease ends. The key has a hash tag of its own; on a Redis Cluster it is one
-- call to one master.
-- Returns {now, 1 if the caller's lease had lapsed (or was never taken) else 0,
--          {NODE, LEASE-END, ...} of the live nodes, {NODE, ...} of the lapsed ones}.

local node, lease, now = ARGV[1], tonumber(ARGV[2]), now_ms()
local before = tonumber(redis.call('ZSCORE', KEYS[1], node))
local lapsed = (not before or before < now) and 1 or 0
if lease > 0 then
  redis.call('ZADD', KEYS[1], now + lease, node)
else
  redis.call('ZREM', KEYS[1], node)
end
for i = 3, #ARGV do
  local ends = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i]))
  if ends and ends < now then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return {now, lapsed, redis.call('ZRANGE', KEYS[1], now, '+inf', 'BYSCORE', 'WITHSCORES'),
        redis.call('ZRANGE', KEYS[1], '-inf', '(' .. now, 'BYSCORE')}
