-- reshard_begin.lua: begin changing the namespace's shard count (a live reshard).
--
-- KEYS[1] layout   KEYS[2] drained   (see layout.lua)
-- ARGV[1] the generation the caller read   ARGV[2] the new shard count
-- ARGV[3] the node that asks (recorded as `by`)   ARGV[4] the layout's channel
--
-- Only from the generation the caller read, and only when no reshard runs: two nodes
-- that ask at once begin one reshard. The new generation maps every key with the new
-- count; the old count stays in `from` until every old shard is drained
-- (reshard_drained.lua). The new generation is published on the channel.
-- Returns 1 if this call began it, else 0.

local gen = tonumber(redis.call('HGET', KEYS[1], 'gen') or 0)
local from = tonumber(redis.call('HGET', KEYS[1], 'from') or 0)
local shards = tonumber(redis.call('HGET', KEYS[1], 'shards') or 0)
if gen ~= tonumber(ARGV[1]) or from ~= 0 or shards == tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'gen', gen + 1, 'shards', ARGV[2], 'from', shards,
           'began', now_ms(), 'ended', 0, 'moved', 0, 'by', ARGV[3], 'was', 0)
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[4], gen + 1)
return 1
