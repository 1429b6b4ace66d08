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
-- command): a call of a few hundred keys holds the server for a millisecond or two.
-- Returns {keys re-queued, keys that were not dead...}.

local meta, next_key, due_key, dead_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, not_dead = now_ms(), {}
local keys = {}
for i = 2, #ARGV do keys[i - 1] = ARGV[i] end
if #keys == 0 then
  if ARGV[1] ~= '' then wake(next_key, ARGV[1], now) end
  return {0}
end

local states = read_fields(meta, keys)
local scores = {}
for i = 1, #keys, CHUNK do
  local part = redis.call('ZMSCORE', dead_key, unpack(keys, i, math.min(i + CHUNK - 1, #keys)))
  for j = 1, #part do scores[i + j - 1] = part[j] end
end

-- FIRST and LAST of a dead value (nil for any other): one pattern match for the usual
-- form, the general decode for any other (a table and a split a key cost ~1 us more).
local function dead_times(v)
  local f, l = string.match(v, '^D|(%d+)|(%d+)|')
  if f then return tonumber(f), tonumber(l) end
  local s = decode(v)
  if s and s.kind == 'D' then return s.first, s.last end
  return nil
end

local back, fields, entries, seen, n = {}, {}, {}, {}, 0
for i = 1, #keys do
  local key = keys[i]
  local first, last
  if scores[i] and states[i] and not seen[key] then first, last = dead_times(states[i]) end
  if first then
    seen[key] = true
    n = n + 1
    back[n] = key
    fields[2 * n - 1], fields[2 * n] = key, pending(first, last, 0, now)
    entries[2 * n - 1], entries[2 * n] = now, key
  else
    not_dead[#not_dead + 1] = key
  end
end
if #back > 0 then
  each_chunk('ZREM', dead_key, back)
  each_chunk('HSET', meta, fields)
  each_chunk('ZADD', due_key, entries)
  if ARGV[1] ~= '' then wake(next_key, ARGV[1], now) end
end
return {#back, unpack(not_dead)}
