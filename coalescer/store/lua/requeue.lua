#!lua flags=allow-oom
-- requeue.lua: bring dead-lettered keys of one rule back (coalescer retry).
--
-- KEYS[1] meta   KEYS[2] next-wake   KEYS[3] due:RULE   KEYS[4] dead:RULE
-- ARGV[1] wake channel ('': wake no poller, a later call of the caller's does);
-- ARGV[2...] the keys (none: only wake the poller, for keys earlier calls re-queued)
--
-- Each key that is dead goes back to pending, due now, with fresh attempts.
-- Keys that are not dead (and a key named twice, the second time) are left alone
-- and reported. The keys' states and dead-set entries are read with one HMGET and
-- one ZMSCORE, and written with one HSET, ZADD and ZREM each (a few thousand a
-- command; _requeue.lua): a call of a few hundred keys holds the server for about a
-- millisecond.
-- Returns {keys re-queued, keys that were not dead...}.

local meta, next_key, due_key, dead_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = now_ms()
local keys = {}
for i = 2, #ARGV do keys[i - 1] = ARGV[i] end
if #keys == 0 then
  if ARGV[1] ~= '' then wake(next_key, ARGV[1], now) end
  return {0}
end

local scores = {}
for i = 1, #keys, CHUNK do
  local part = redis.call('ZMSCORE', dead_key, unpack(keys, i, math.min(i + CHUNK - 1, #keys)))
  for j = 1, #part do scores[i + j - 1] = part[j] end
end

local back, not_dead = requeue_keys(meta, due_key, dead_key, keys, scores, now)
if back > 0 and ARGV[1] ~= '' then wake(next_key, ARGV[1], now) end
return {back, unpack(not_dead)}
