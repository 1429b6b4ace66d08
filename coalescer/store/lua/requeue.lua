#!lua flags=allow-oom
-- requeue.lua: bring dead-lettered keys of one rule back (coalescer retry).
--
-- KEYS[1] meta   KEYS[2] next-wake   KEYS[3] due:RULE   KEYS[4] dead:RULE
-- ARGV[1] wake channel; ARGV[2...] the keys
--
-- Each key that is dead goes back to pending, due now, with fresh attempts.
-- Keys that are not dead are left alone and reported.
-- Returns {keys re-queued, keys that were not dead...}.

local meta, next_key, due_key, dead_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, requeued, not_dead = now_ms(), 0, {}

for i = 2, #ARGV do
  local key = ARGV[i]
  local s = decode(redis.call('HGET', meta, key))
  if s and s.kind == 'D' and redis.call('ZREM', dead_key, key) == 1 then
    schedule(meta, due_key, key, s.first, s.last, 0, now)
    requeued = requeued + 1
  else
    not_dead[#not_dead + 1] = key
  end
end
if requeued > 0 then wake(next_key, ARGV[1], now) end
return {requeued, unpack(not_dead)}
