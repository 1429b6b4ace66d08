#!lua flags=allow-oom
-- peers.lua: the worker nodes of a shard and the rules each registered.
--
-- KEYS[1] nodes   KEYS[2] rules
-- ARGV[1] unused (a node leaves the set when it shuts down or its node lease lapses,
--         never by the age of its entry: see heartbeat in _lib.lua)
--
-- Read-only. Returns {now, NODE, LAST-SEEN-MS, RULES, NODE, ...}, RULES being
-- the node's "|NAME=FP|...|" entry, or "" for a node that registered none.

local now = now_ms()
local out = {now}
local seen = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #seen, 2 do
  out[#out + 1] = seen[i]
  out[#out + 1] = seen[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], seen[i]) or ''
end
return out
