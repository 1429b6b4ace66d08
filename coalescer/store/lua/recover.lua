#!lua flags=allow-oom
-- recover.lua: re-queue claims whose holder stopped renewing their lease.
--
-- KEYS[1] meta   KEYS[2] next-wake
-- KEYS[3+2r], KEYS[4+2r]   due:RULE and inflight:RULE of rule r (r = 0, 1, ..., R - 1)
-- ARGV[1] wake channel   ARGV[2] most keys to recover per rule in this call
-- ARGV[3+r] the retry attempts of rule r (optional: no limit when absent)
-- then, optionally (the attempts of all R rules given first): per rule r, N, then N
-- pairs (KEY, LEASE-SCORE): the claims the caller judged lapsed by its own clock.
--
-- Without the pairs, every claim whose lease score is before the server's clock is
-- re-queued (a drain in a test process). With them, only the listed claims, and only
-- while their lease score is still exactly the one the caller read: a holder that
-- renewed since (any renewal writes a new score) keeps its claim. The caller (a leader)
-- decides which leases lapsed by how long it saw their score unchanged, so a step of
-- the server's clock expires nothing early.
--
-- Each re-queued claim goes back to pending, due now, with the attempt it was on
-- counted (a holder that keeps dying reaches the retry limit), merged with any touch
-- that came while it ran. When the attempt that died was the rule's last, a touch
-- that came while it ran starts a new burst with fresh attempts instead (as fail.lua
-- re-arms it), so it is refreshed, not dead-lettered. Bounded per call.
-- Returns {keys recovered}.

local meta, next_key, now = KEYS[1], KEYS[2], now_ms()
local limit, recovered = tonumber(ARGV[2]), 0
local rules = (#KEYS - 2) / 2
local listed = #ARGV > 2 + rules
local pos = 3 + rules

-- {first, last, attempts, due, sched} of the pending state an expired claim goes back
-- to; a touch with a time of its own while it ran sets the due time (and `sched`).
local function requeued(s, max_attempts)
  if not s or s.kind ~= 'R' then return now, now, 0, now end
  if not s.rdue then return s.first, s.last, s.attempt, now end
  if s.attempt >= max_attempts then return s.rfirst, s.rlast, 0, s.rdue, s.rsched end
  local due = s.rsched and math.max(s.rdue, now) or now
  return math.min(s.first, s.rfirst), math.max(s.last, s.rlast), s.attempt, due, s.rsched
end

-- The claims of one rule to re-queue: the listed ones still at their read score, or
-- those expired by the server's clock.
local function lapsed(inflight_key)
  if not listed then
    return redis.call('ZRANGEBYSCORE', inflight_key, '-inf', now, 'LIMIT', 0, limit)
  end
  local n, out = tonumber(ARGV[pos]), {}
  for i = pos + 1, pos + 2 * n, 2 do
    local score = redis.call('ZSCORE', inflight_key, ARGV[i])
    if score and tonumber(score) == tonumber(ARGV[i + 1]) and #out < limit then
      out[#out + 1] = ARGV[i]
    end
  end
  pos = pos + 1 + 2 * n
  return out
end

for r = 0, rules - 1 do
  local due_key, inflight_key = KEYS[3 + 2 * r], KEYS[4 + 2 * r]
  local max_attempts = tonumber(ARGV[3 + r]) or math.huge
  for _, key in ipairs(lapsed(inflight_key)) do
    local first, last, attempts, due, sched = requeued(decode(redis.call('HGET', meta, key)),
                                                       max_attempts)
    redis.call('ZREM', inflight_key, key)
    schedule(meta, due_key, key, first, last, attempts, due, sched)
    recovered = recovered + 1
  end
end
if recovered > 0 then wake(next_key, ARGV[1], now) end
return {recovered}
