-- _requeue.lua: the step requeue.lua and requeue_first.lua share (prepended after
-- _lib.lua): dead-lettered keys of one rule brought back to pending.

-- FIRST and LAST of a dead value (nil for any other): one pattern match for the usual
-- form, the general decode for any other (a table and a split a key cost ~1 us more).
local function dead_times(v)
  local f, l = string.match(v, '^D|(%d+)|(%d+)|')
  if f then return tonumber(f), tonumber(l) end
  local s = decode(v)
  if s and s.kind == 'D' then return s.first, s.last end
  return nil
end

-- Each of `keys` that is dead (its state in `meta` a dead one, and `listed[i]` true: it
-- is in `dead_key`; `listed` nil: every key was read from that set) goes back to
-- pending, due `now`, with fresh attempts, and leaves the dead set. Its states are read
-- with one HMGET and it is written with one ZREM, HSET and ZADD (a few thousand a
-- command). A key named twice counts once. Returns how many came back and the keys that
-- did not.
local function requeue_keys(meta, due_key, dead_key, keys, listed, now)
  local states = read_fields(meta, keys)
  local back, fields, entries, seen, n, not_dead = {}, {}, {}, {}, 0, {}
  for i = 1, #keys do
    local key = keys[i]
    local first, last
    if (listed == nil or listed[i]) and states[i] and not seen[key] then
      first, last = dead_times(states[i])
    end
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
  if n > 0 then
    each_chunk('ZREM', dead_key, back)
    each_chunk('HSET', meta, fields)
    due_add(meta, due_key, entries)
  end
  return n, not_dead
end
