-- reshard_drained.lua: an old shard holds no key of another shard any more.
--
-- KEYS[1] layout   KEYS[2] drained   (see layout.lua)
-- ARGV[1] the generation of the reshard   ARGV[2] the old shard
-- ARGV[3] how many keys its mover moved since it last said so   ARGV[4] the layout's channel
--
-- When every old shard (0 .. from - 1) is drained the reshard is done: a new
-- generation with `from` 0 (writers then write every key straight to its new shard).
-- Each call publishes the generation it leaves on the channel.
-- Returns 1 if this call ended the reshard, else 0 (also for a stale generation).

if tonumber(redis.call('HGET', KEYS[1], 'gen') or 0) ~= tonumber(ARGV[1]) then return 0 end
local from = tonumber(redis.call('HGET', KEYS[1], 'from') or 0)
if from == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'moved', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[2])
if redis.call('SCARD', KEYS[2]) < from then
  redis.call('PUBLISH', ARGV[4], ARGV[1])
  return 0
end
redis.call('HSET', KEYS[1], 'gen', tonumber(ARGV[1]) + 1, 'from', 0, 'was', from,
           'ended', now_ms())
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[4], tonumber(ARGV[1]) + 1)
return 1
