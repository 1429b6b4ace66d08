-- run_now.lua: make one pending key due now (an operator's "run now": window skipped).
--
-- KEYS[1] meta   KEYS[2] due:RULE of the key's rule   KEYS[3] next-wake
-- ARGV[1] the key   ARGV[2] the shard's wake channel
--
-- A pending key (in its window, waiting for its max wait, its own time or a retry's
-- backoff) gets the server's now as the due time of its state in meta and as its
-- score in due:RULE (the score stays a lower bound of DUE, as _lib.lua needs), and
-- the shard's poller is woken if it sleeps past now. A key already due is left as it
-- is. Running, dead and unknown keys are untouched.
-- Returns {now, state}: state "hastened", "due" (already due), "running", "dead" or
-- "idle" (no state here).

local meta, due_key, key, now = KEYS[1], KEYS[2], ARGV[1], now_ms()
local s = decode(redis.call('HGET', meta, key))
if not s then return {now, 'idle'} end
if s.kind == 'R' then return {now, 'running'} end
if s.kind == 'D' then return {now, 'dead'} end
local score = tonumber(redis.call('ZSCORE', due_key, key))
if s.due <= now and score and score <= now then return {now, 'due'} end
redis.call('HSET', meta, key, pending(s.first, s.last, s.attempts, now))
due_add(meta, due_key, {now, key})
wake(KEYS[3], ARGV[2], now)
return {now, 'hastened'}
