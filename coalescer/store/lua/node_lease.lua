#!lua flags=allow-oom
-- node_lease.lua: renew (or give up) a worker node's lease; read every node's.
--
-- KEYS[1] leases (ZSET node id -> lease end, server ms)
-- ARGV[1] node id   ARGV[2] lease ms (0: leave: the caller's lease is dropped;
--         -1: a look: nothing is renewed, every lease is read)
-- ARGV[3] renewal period ms: a renewal in the first twentieth of a period ends at the
--         period's start plus the lease, a later one (or 0) at now plus the lease
-- ARGV[4...] pairs (NODE, LEASE-END): nodes the caller judged lapsed (by its own clock)
--            and whose shard entries it forgot: each dropped from the set only while its
--            lease end is still the one the caller read (a renewal since keeps it)
--
-- One lease per node stands for every shard it leads (acquire.lua): a node renews it
-- with one call per period whatever the number of shards, and standbys read here when
-- a leader's lease ends. Renewed at the start of a period, every node's lease ends at
-- the same instant (the period's start plus the lease), so one look just after it
-- sees every node that failed to renew. Whether a lease lapsed is judged by each
-- reader with its own clock (worker/lease_clock.py): a step of the server's clock
-- lapses nothing here. The key has a hash tag of its own; on a Redis Cluster it is one
-- call to one master.
-- Returns {now, 1 if the caller's lease was not in the set (never taken, or dropped by
--          a node that judged it lapsed) else 0, {NODE, LEASE-END, ...} of every node}.

local node, lease, period, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), now_ms()
if lease < 0 then return {now, 0, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')} end
local before = tonumber(redis.call('ZSCORE', KEYS[1], node))
local lapsed = before and 0 or 1
if lease > 0 then
  local ends = now + lease
  -- a renewal early in its period ends with the period's others; a late one (a slow
  -- link) gets its whole lease
  if period > 0 and now % period <= period / 20 then ends = now - now % period + lease end
  if before and ends <= before then ends = before + 1 end  -- a renewal always writes anew
  redis.call('ZADD', KEYS[1], ends, node)
else
  redis.call('ZREM', KEYS[1], node)
end
for i = 4, #ARGV - 1, 2 do
  local ends = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i]))
  if ends and ends == tonumber(ARGV[i + 1]) then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return {now, lapsed, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')}
