-- traces_put.lua: keep the trace contexts of touches (or of a failed try) beside their
-- keys, for the refresh that will run for them to link to (one shard).
--
-- KEYS[1]   meta hash
-- KEYS[1+i] the traces key of key i (keys.py ShardKeys.traces)
-- ARGV[1]   K: how many contexts to keep at each end of a burst
-- ARGV[2]   GRACE: how long, ms, a traces key outlives its key's due time (or now, for a
--           key running or dead-lettered)
-- ARGV[1+2i] key i   ARGV[2+2i] what to add for it: "DROPPED|FIRST|LAST|TRIED", FIRST
--           and LAST comma-joined W3C traceparent strings, DROPPED how many contexts
--           between them were left out, TRIED the traceparent of a failed try (or "")
--
-- Only a key that has a state here (pending, scheduled, running, dead-lettered) gets
-- its contexts: one that was never accepted, or was already dropped (cancelled, acked,
-- purged, trimmed), gets none; every step that drops a state deletes its traces key.
-- A key's value has the same form. The contexts kept, old then new, in order, keep their
-- first K and last K; the others are counted in DROPPED. TRIED is the newest given.
-- The traces key expires GRACE after the key's due time (a later touch moves it).
-- Returns the number of keys written.

local meta, keep, grace = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()

local function parts(v)
  local dropped, first, last, tried = string.match(v or '0|||', '^(%d*)|([^|]*)|([^|]*)|?(.*)$')
  local seq = {}
  for tp in string.gmatch(first or '', '[^,]+') do seq[#seq + 1] = tp end
  for tp in string.gmatch(last or '', '[^,]+') do seq[#seq + 1] = tp end
  return tonumber(dropped) or 0, seq, tried or ''
end

local function merged(old, new)
  local d1, s1, t1 = parts(old)
  local d2, s2, t2 = parts(new)
  for i = 1, #s2 do s1[#s1 + 1] = s2[i] end
  local dropped, n = d1 + d2, #s1
  local first, last = {}, {}
  for i = 1, math.min(keep, n) do first[#first + 1] = s1[i] end
  local from = math.max(keep + 1, n - keep + 1)
  dropped = dropped + math.max(0, from - keep - 1)
  for i = from, n do last[#last + 1] = s1[i] end
  local tried = t2 ~= '' and t2 or t1
  return dropped .. '|' .. table.concat(first, ',') .. '|' .. table.concat(last, ',') .. '|'
    .. tried
end

-- When the traces key of a key in state `s` expires, server ms.
local function expiry(s)
  local due = s and (s.kind == 'P' and s.due or s.kind == 'R' and s.rdue) or now
  return math.max(due, now) + grace
end

local written = 0
for i = 2, #KEYS do
  local v = redis.call('HGET', meta, ARGV[2 * i - 1])
  if v then
    local old = redis.call('GET', KEYS[i])
    redis.call('SET', KEYS[i], merged(old, ARGV[2 * i]), 'PXAT', int(expiry(decode(v))))
    written = written + 1
  end
end
return written
