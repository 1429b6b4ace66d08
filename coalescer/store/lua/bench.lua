-- bench.lua: a node whose refreshes fail gives its shards up for a cool-off, or reads
-- which nodes did.
--
-- KEYS[1] benched (ZSET node id -> end of its cool-off, server ms)
-- KEYS[2] leases (ZSET node id -> lease end, server ms: node_lease.lua)
-- ARGV[1] node id   ARGV[2] cool-off ms (-1: a read: nobody is benched)
-- ARGV[3...] the other nodes the caller counts live
--
-- The caller is benched (its cool-off end written) only if one of ARGV[3...] still has
-- a lease and is not benched itself: it gives its shards up only to a node that can
-- take them, and of two failing nodes that ask at once one stays. Cool-offs that
-- ended are dropped. The end is advisory: the other nodes leave a benched node out
-- of their fair share of the shards until then; the benched node times its own
-- cool-off with its own clock.
-- Returns {now, 1 if the caller was benched else 0, {NODE, COOL-OFF-END, ...} of every
--          node benched now}.

local node, cool_off, now = ARGV[1], tonumber(ARGV[2]), now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local benched = 0
if cool_off >= 0 then
  for i = 3, #ARGV do
    local other = ARGV[i]
    if other ~= node and redis.call('ZSCORE', KEYS[2], other)
        and not redis.call('ZSCORE', KEYS[1], other) then
      redis.call('ZADD', KEYS[1], now + cool_off, node)
      benched = 1
      break
    end
  end
end
return {now, benched, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')}
