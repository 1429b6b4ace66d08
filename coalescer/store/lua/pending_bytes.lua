#!lua flags=allow-oom
-- pending_bytes.lua: the bytes one shard holds for its keys (limits.pending_bytes),
-- counted a page at a time, plus what the writes since the last full count added.
--
-- KEYS[1] meta   KEYS[2] the shard's bytes hash (fields: total, partial, cursor, added)
-- ARGV[1] ITEMS-PREFIX, ARGV[2] CLAIMED-PREFIX: a key's item sets ("": no rule has
--         items, none looked at)   ARGV[3] TRACES-PREFIX: a key's trace contexts ("":
--         tracing off, none looked at)
-- ARGV[4] PAGE: meta entries read in this call, at most
-- ARGV[5] optionally, QUIET-PREFIX: a key's quiet marker (a rule with `edge: leading`,
--         see upsert.lua) is counted with its key (a marker outlives its key's state by
--         at most a window: upsert.lua adds a new marker's bytes when it sets it)
--
-- A count reads the meta hash with HSCAN, from cursor 0 back to 0, over as many calls as
-- it takes (PAGE entries each, never a blocking scan); "partial" sums what it has read.
-- A key (any state: pending, scheduled, running, dead-lettered) counts its name twice
-- (its meta field and its due or dead entry), its state, KEY_OVERHEAD bytes of Redis's
-- own, and what MEMORY USAGE says of its items set, claimed set, trace contexts and
-- timeline. (A timeline outlives its key's state by up to an hour: counted with the
-- state, and from upsert.lua's "added" until the next count ends.)
-- When the count ends, "total" becomes it and "added" starts again at 0; upsert.lua
-- adds to "added" what each write adds (a new key, its items), so growth is seen at
-- once and what leaves (an ack, a cancel, a purge) is seen at the end of a count.
-- Returns {total + added, 1 if a count ended in this call else 0}.

local KEY_OVERHEAD = 80
local meta, bytes = KEYS[1], KEYS[2]
local items_prefix, claimed_prefix, traces_prefix = ARGV[1], ARGV[2], ARGV[3]
local page = tonumber(ARGV[4])
local quiet_prefix = ARGV[5] or ''

local function usage(key)
  return tonumber(redis.call('MEMORY', 'USAGE', key) or 0) or 0
end

local function of_key(key, state)
  local n = 2 * #key + #state + KEY_OVERHEAD
  if items_prefix ~= '' then
    n = n + usage(items_prefix .. key) + usage(claimed_prefix .. key)
  end
  if traces_prefix ~= '' then n = n + usage(traces_prefix .. key) end
  n = n + usage(timeline_of(meta, key))
  if quiet_prefix ~= '' then n = n + usage(quiet_prefix .. key) end
  return n
end

local held = redis.call('HMGET', bytes, 'total', 'partial', 'cursor', 'added')
local total, partial = tonumber(held[1]) or 0, tonumber(held[2]) or 0
local cursor, added = held[3] or '0', tonumber(held[4]) or 0
local looked = 0
repeat
  local reply = redis.call('HSCAN', meta, cursor, 'COUNT', page)
  cursor = reply[1]
  local entries = reply[2]
  for i = 1, #entries, 2 do partial = partial + of_key(entries[i], entries[i + 1]) end
  looked = looked + #entries / 2
until cursor == '0' or looked >= page
if cursor == '0' then
  redis.call('HSET', bytes, 'total', partial, 'partial', 0, 'cursor', 0, 'added', 0)
  return {partial, 1}
end
redis.call('HSET', bytes, 'partial', partial, 'cursor', cursor)
return {total + added, 0}
