#!lua flags=allow-oom
-- release.lua: give up a shard's leader lease (clean shutdown, rebalancing).
--
-- KEYS[1] leader   KEYS[2] nodes
-- ARGV[1] the caller's leader value "EPOCH|NODE-ID"   ARGV[2] wake channel
-- ARGV[3] node id   ARGV[4] 1 to also leave the live-node set, else 0
--
-- Deletes the lease only if the caller still holds it, and announces it on
-- the wake channel so a standby takes over at once instead of at expiry.
-- Returns 1 if released, 0 if the caller did not hold it.

if ARGV[4] == '1' then redis.call('ZREM', KEYS[2], ARGV[3]) end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], 'released')
return 1
