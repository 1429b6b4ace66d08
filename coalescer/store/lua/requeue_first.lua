#!lua flags=allow-oom
-- requeue_first.lua: bring back the dead-lettered keys at given ranks of one rule's
-- dead set (a bulk retry of a whole rule: no key goes through the client).
--
-- KEYS[1] meta   KEYS[2] next-wake   KEYS[3] due:RULE   KEYS[4] dead:RULE
-- ARGV[1] wake channel ('': wake no poller, a later call of the caller's does)
-- ARGV[2] FROM, the rank of the first entry to read (0: the set's first)
-- ARGV[3] COUNT, how many entries to read at most
--
-- Reads the entries at ranks FROM to FROM + COUNT - 1 of dead:RULE (one ZRANGE) and
-- brings each key whose state is dead back to pending, due now, with fresh attempts
-- (_requeue.lua); the others stay in the set, where the caller's next call starts
-- after them (its FROM + entries read - keys re-queued). A call of a few hundred
-- entries holds the server for about a millisecond.
-- Returns {keys re-queued, entries read}.

local meta, next_key, due_key, dead_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local from, count = tonumber(ARGV[2]), tonumber(ARGV[3])
local keys = redis.call('ZRANGE', dead_key, from, from + count - 1)
if #keys == 0 then return {0, 0} end
local now = now_ms()
local back = requeue_keys(meta, due_key, dead_key, keys, nil, now)
if back > 0 and ARGV[1] ~= '' then wake(next_key, ARGV[1], now) end
return {back, #keys}
