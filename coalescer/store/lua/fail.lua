#!lua flags=allow-oom
-- fail.lua: finish claims whose refresh failed or timed out.
--
-- KEYS[1] meta   KEYS[2] next-wake   KEYS[3] history
-- KEYS[4+3g], KEYS[5+3g], KEYS[6+3g]   due:RULE, inflight:RULE, dead:RULE of group g
-- ARGV[1] wake channel   ARGV[2] node id   ARGV[3] history length (0: none)
-- then per group g: RULE, MAX_ATTEMPTS, N, then N septuples (key, token,
-- retry delay ms, error text, outcome "failure" or "timeout", start ms, duration ms)
--
-- Only the holder of the claim's fencing token may fail it (else: stale). An
-- attempt below MAX_ATTEMPTS is retried after its delay (the caller draws the
-- backoff and jitter), keeping the burst's first touch; the last attempt
-- dead-letters the key, unless it was touched while it ran, which counts as a
-- new touch: a new burst with fresh attempts. A touch with a time of its own while
-- it ran replaces the retry's due time too (the latest schedule wins): the retry
-- waits for that time. Each try is appended to the history with its outcome and
-- error ("lost" for a stale one), and to its key's timeline as an "o" event (_lib.lua).
-- Returns {retried, {dead-lettered keys...}, {stale keys...}}.

local meta, next_key, history, now = KEYS[1], KEYS[2], KEYS[3], now_ms()
local node, maxlen = ARGV[2], tonumber(ARGV[3])
local retried, died, stale, earliest, pos = 0, {}, {}, nil, 4

local function retry(due_key, key, r, delay)
  local first, last = r.first, r.last
  if r.rdue then first, last = math.min(first, r.rfirst), math.max(last, r.rlast) end
  local due = r.rsched and math.max(r.rdue, now) or now + delay
  schedule(meta, due_key, key, first, last, r.attempt, due, r.rsched, nil, r.rprio)
  return due
end

-- A claim past the limit (its holder died on the last attempt: recover.lua counted
-- it) was never run, so the dead letter counts max_attempts tries, not its number.
local function give_up(due_key, dead_key, key, r, err, max_attempts)
  local due = rearm(meta, due_key, key, r)
  if due then return due end
  redis.call('HSET', meta, key, dead(r.first, r.last, math.min(r.attempt, max_attempts), err))
  redis.call('ZADD', dead_key, now, key)
  died[#died + 1] = key
  return nil
end

for g = 0, (#KEYS - 3) / 3 - 1 do
  local due_key, inflight_key, dead_key = KEYS[4 + 3 * g], KEYS[5 + 3 * g], KEYS[6 + 3 * g]
  local rule, max_attempts, n = ARGV[pos], tonumber(ARGV[pos + 1]), tonumber(ARGV[pos + 2])
  for i = pos + 3, pos + 2 + 7 * n, 7 do
    local key, token, err = ARGV[i], ARGV[i + 1], ARGV[i + 3]
    local r = held(meta, key, token)
    local outcome, next = ARGV[i + 4], ''
    if not r then
      stale[#stale + 1] = key
      record(history, maxlen, key, rule, node, token, '', '', ARGV[i + 5], ARGV[i + 6], 'lost',
             err)
      outcome = 'lost'
    else
      redis.call('ZREM', inflight_key, key)
      if r.attempt < max_attempts then
        local due = retry(due_key, key, r, tonumber(ARGV[i + 2]))
        earliest, next = min(earliest, due), 'retry@' .. int(due)
        retried = retried + 1
      else
        local due = give_up(due_key, dead_key, key, r, err, max_attempts)
        earliest, next = min(earliest, due), due and 'again@' .. int(due) or 'dead'
      end
      record(history, maxlen, key, rule, node, token, r.attempt, int(r.due), ARGV[i + 5],
             ARGV[i + 6], ARGV[i + 4], err)
    end
    timeline_push(timeline_of(meta, key), 'o|' .. int(now) .. '|' .. token .. '|' .. outcome
                  .. '|' .. ARGV[i + 5] .. '|' .. ARGV[i + 6] .. '|0|' .. next .. '|' .. err)
  end
  pos = pos + 3 + 7 * n
end
wake(next_key, ARGV[1], earliest)
return {retried, died, stale}
