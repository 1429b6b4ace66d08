#!lua flags=allow-oom
-- purge.lua: delete dead-lettered keys of one rule for good (coalescer dead purge).
--
-- KEYS[1] meta   KEYS[2] dead:RULE
-- KEYS[3...] optionally, the quiet marker of each key (upsert.lua), in ARGV's order
-- ARGV[1] ITEMS-PREFIX   ARGV[2] CLAIMED-PREFIX   ARGV[3] TRACES-PREFIX
-- ARGV[4...] the keys
--
-- A key is removed (its state and its dead-letter entry) only if it is still
-- dead: a key touched or re-queued since it was listed is left alone and
-- reported. A purged key that is touched again starts a fresh burst. Its items
-- (pending and claimed, see _lib.lua), its trace contexts, its quiet marker and its
-- timeline are deleted with it.
-- Returns {keys purged, keys that were not dead...}.

local meta, dead_key, items_prefix, claimed_prefix = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local traces_prefix = ARGV[3]
local purged, not_dead = 0, {}

for i = 4, #ARGV do
  local key = ARGV[i]
  local s = decode(redis.call('HGET', meta, key))
  if s and s.kind == 'D' and redis.call('ZREM', dead_key, key) == 1 then
    redis.call('HDEL', meta, key)
    redis.call('DEL', items_prefix .. key, claimed_prefix .. key, traces_prefix .. key,
               timeline_of(meta, key))
    if KEYS[i - 1] then redis.call('DEL', KEYS[i - 1]) end
    purged = purged + 1
  else
    not_dead[#not_dead + 1] = key
  end
end
return {purged, unpack(not_dead)}
