-- recover.lua: re-queue claims whose lease expired (their holder died).
--
-- KEYS[1] meta   KEYS[2] next-wake
-- KEYS[3+2r], KEYS[4+2r]   due:RULE and inflight:RULE of rule r (r = 0, 1, ...)
-- ARGV[1] wake channel   ARGV[2] most keys to recover per rule in this call
-- ARGV[3+r] the retry attempts of rule r (optional: no limit when absent)
--
-- Each expired claim goes back to pending, due now, with the attempt it was
-- on counted (a holder that keeps dying reaches the retry limit), merged with
-- any touch that came while it ran. When the attempt that died was the rule's
-- last, a touch that came while it ran starts a new burst with fresh attempts
-- instead (as fail.lua re-arms it), so it is refreshed, not dead-lettered.
-- Bounded per call, so it never runs long.
-- Returns {keys recovered}.

local meta, next_key, now = KEYS[1], KEYS[2], now_ms()
local limit, recovered = tonumber(ARGV[2]), 0

-- {first, last, attempts, due} of the pending state an expired claim goes back to.
local function requeued(s, max_attempts)
  if not s or s.kind ~= 'R' then return now, now, 0, now end
  if not s.rdue then return s.first, s.last, s.attempt, now end
  if s.attempt >= max_attempts then return s.rfirst, s.rlast, 0, s.rdue end
  return math.min(s.first, s.rfirst), math.max(s.last, s.rlast), s.attempt, now
end

for r = 0, (#KEYS - 2) / 2 - 1 do
  local due_key, inflight_key = KEYS[3 + 2 * r], KEYS[4 + 2 * r]
  local max_attempts = tonumber(ARGV[3 + r]) or math.huge
  local expired = redis.call('ZRANGEBYSCORE', inflight_key, '-inf', now, 'LIMIT', 0, limit)
  for _, key in ipairs(expired) do
    local first, last, attempts, due = requeued(decode(redis.call('HGET', meta, key)),
                                                max_attempts)
    redis.call('ZREM', inflight_key, key)
    schedule(meta, due_key, key, first, last, attempts, due)
    recovered = recovered + 1
  end
end
if recovered > 0 then wake(next_key, ARGV[1], now) end
return {recovered}
