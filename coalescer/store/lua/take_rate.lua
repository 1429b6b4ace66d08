#!lua flags=allow-oom
-- take_rate.lua: takes refresh starts from a rule's rate, a token bucket shared by
-- every shard's poller in the cluster (its key has a hash tag of its own).
--
-- KEYS[1] the rule's bucket, a HASH {tokens, at}: the tokens left at server time `at` ms
-- ARGV[1] starts allowed per period   ARGV[2] the period, ms   ARGV[3] the bucket's size
-- ARGV[4] how many starts the caller wants now (0: none, e.g. only giving back)
-- ARGV[5] starts the caller took before and did not use, given back first
--
-- The bucket refills at ARGV[1] tokens per ARGV[2] ms up to its size; a missing
-- bucket is full. Grants the whole tokens there are, up to ARGV[4]. The key expires
-- once it would be full again, so an idle rule leaves nothing behind.
-- Returns {granted, wait ms}: wait is 0 when everything wanted was granted, else the
-- time until min(what is still wanted, the bucket's size) tokens are there.

local per_ms = tonumber(ARGV[1]) / tonumber(ARGV[2])
local size = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local now = now_ms()
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = size
if state[1] then
  tokens = math.min(size, tonumber(state[1]) + math.max(0, now - tonumber(state[2])) * per_ms)
end
tokens = math.min(size, tokens + tonumber(ARGV[5]))
local granted = math.min(want, math.floor(tokens + 1e-9))
tokens = tokens - granted
local wait = 0
if granted < want then
  local need = math.min(want - granted, size)
  wait = math.max(1, math.ceil((need - tokens) / per_ms))
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', int(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((size - tokens) / per_ms) + 1000)
return {granted, wait}
