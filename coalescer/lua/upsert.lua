-- upsert.lua: schedule one batch of touched keys (one shard, one or more rules).
--
-- KEYS[1]   meta hash          KEYS[2]  next-wake string
-- KEYS[3+2g], KEYS[4+2g]       due:RULE and dead:RULE of group g (g = 0, 1, ...)
-- ARGV[1]   wake channel
-- ARGV ...  per group g, in KEYS order: WINDOW_MS, MAX_WAIT_MS, N, and the N keys
--           joined by NUL characters in one argument (cheap for the client to send)
--
-- Per key, with t the server time: a new burst is due at t + W; a burst that
-- goes on is due at max(old due, min(t + W, first + M)) (the max keeps a retry
-- backoff). A running key records the touch for a re-arm when it finishes. A
-- dead-lettered key starts a new burst with fresh attempts.
-- A key whose own state cannot be read (a script error while touching it, e.g. a
-- corrupted meta entry) is skipped, and returned with the error, while every other
-- key is scheduled: one bad key never fails the others. An error reply of a Redis
-- command (READONLY, OOM, WRONGTYPE, ...) is about the server or the shard, not the
-- key: it fails the whole call.
-- Returns {server time ms, keys scheduled, 1 if a poller was woken else 0,
--          {key, error, key, error, ...} of the keys that failed}.

local meta, next_key, channel = KEYS[1], KEYS[2], ARGV[1]
local now = now_ms()

local function touch_running(key, r, window, max_wait)
  if r.rdue then
    r.rdue = math.max(r.rdue, math.min(now + window, r.rfirst + max_wait))
  else
    r.rfirst, r.rdue = now, now + window
  end
  r.rlast = now
  redis.call('HSET', meta, key, running(r))
end

-- Returns the key's due time when its due set must learn it (a new or dead key),
-- else nil: a re-touch moves only the due time kept in meta (see _lib.lua), and a
-- key seen for the first time is scheduled by the group's one ZADD (adds).
local function touch(due_key, dead_key, key, window, max_wait, fresh, adds)
  if redis.call('HSETNX', meta, key, fresh) == 1 then
    adds[#adds + 1], adds[#adds + 2] = now + window, key
    return now + window
  end
  local s = decode(redis.call('HGET', meta, key))
  if s.kind == 'R' then
    touch_running(key, s, window, max_wait)
  elseif s.kind == 'P' then
    local due = math.max(s.due or 0, math.min(now + window, s.first + max_wait))
    redis.call('HSET', meta, key, pending(s.first, now, s.attempts, due))
  else
    redis.call('ZREM', dead_key, key)
    schedule(meta, due_key, key, now, now, 0, now + window)
    return now + window
  end
  return nil
end

-- The text of a key's own error; a command's error reply ("CODE message", or a
-- table in some servers) is raised again, code kept, and fails the whole call.
local function key_error(e)
  if type(e) == 'table' then error(e) end
  e = tostring(e)
  if string.match(e, '^%u+ ') then error(redis.error_reply(e)) end
  return e
end

local earliest, scheduled, pos, failed = nil, 0, 2, {}
for g = 0, (#KEYS - 2) / 2 - 1 do
  local due_key, dead_key = KEYS[3 + 2 * g], KEYS[4 + 2 * g]
  local window, max_wait = tonumber(ARGV[pos]), tonumber(ARGV[pos + 1])
  local n, joined = tonumber(ARGV[pos + 2]), ARGV[pos + 3]
  local adds, start, fresh = {}, 1, pending(now, now, 0, now + window)
  for _ = 1, n do
    local stop = string.find(joined, '\0', start, true) or (#joined + 1)
    local key = string.sub(joined, start, stop - 1)
    start = stop + 1
    local ok, due = pcall(touch, due_key, dead_key, key, window, max_wait, fresh, adds)
    if ok then
      earliest = min(earliest, due)
      scheduled = scheduled + 1
    else
      failed[#failed + 1], failed[#failed + 2] = key, key_error(due)
    end
  end
  for i = 1, #adds, 4000 do
    redis.call('ZADD', due_key, unpack(adds, i, math.min(i + 3999, #adds)))
  end
  pos = pos + 4
end
return {now, scheduled, wake(next_key, channel, earliest), failed}
