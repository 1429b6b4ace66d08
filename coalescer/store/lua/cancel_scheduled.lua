#!lua flags=allow-oom
-- cancel_scheduled.lua: one page of a bulk cancel: drop the pending keys of one rule of
-- one shard whose due time a touch's own time set (at/delay) and that fall due after
-- a given time (coalescer cancel --rule R --scheduled-after T).
--
-- KEYS[1] meta   KEYS[2] due:RULE   KEYS[3] history
-- ARGV[1] AFTER: epoch ms; keys due strictly after it are looked at
-- ARGV[2] OFFSET: how many keys due after AFTER earlier pages kept (skipped here)
-- ARGV[3] PAGE: keys looked at in this call, at most
-- ARGV[4] ITEMS-PREFIX   ARGV[5] CLAIMED-PREFIX   ARGV[6] TRACES-PREFIX (a key's item
--         sets and trace contexts: the prefix and the key)
-- ARGV[7] RULE   ARGV[8] who cancels (for the history)   ARGV[9] history length (0: none)
-- ARGV[10] 1: count only (a dry run: nothing is changed), else 0
--
-- A key of the page is cancelled when its state is pending with a time of its own (an
-- "S" state, _lib.lua): its state, its due entry, its items and trace contexts go, as
-- cancel.lua drops a pending key, with a history entry "cancelled". Any other key of
-- the page (a plain burst, one in retry backoff without a time of its own) is kept.
-- Keys are read with ZRANGEBYSCORE ... LIMIT OFFSET PAGE: a call's cost is bounded by
-- OFFSET + PAGE, never the size of the due set.
-- Returns {keys cancelled (or, in a dry run, that would be), keys looked at, kept}:
-- the caller's next OFFSET is OFFSET + kept; fewer looked at than PAGE: the last page.

local meta, due_key, history = KEYS[1], KEYS[2], KEYS[3]
local after, offset, page = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local items_prefix, claimed_prefix, traces_prefix = ARGV[4], ARGV[5], ARGV[6]
local rule, who, maxlen, dry = ARGV[7], ARGV[8], tonumber(ARGV[9]), ARGV[10] == '1'
local now = now_ms()

local keys = redis.call('ZRANGEBYSCORE', due_key, '(' .. after, '+inf', 'LIMIT', offset, page)
local cancelled, kept = 0, 0
for _, key in ipairs(keys) do
  local s = decode(redis.call('HGET', meta, key))
  if s and s.kind == 'P' and s.sched then
    cancelled = cancelled + 1
    if dry then
      kept = kept + 1  -- still there: the next page starts after it
    else
      redis.call('ZREM', due_key, key)
      redis.call('HDEL', meta, key)
      redis.call('DEL', items_prefix .. key, claimed_prefix .. key, traces_prefix .. key)
      record(history, maxlen, key, rule, who, '', '', int(s.due), now, 0, 'cancelled')
    end
  else
    kept = kept + 1
  end
end
return {cancelled, #keys, kept}
