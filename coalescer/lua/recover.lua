-- recover.lua: re-queue claims whose lease expired (their holder died).
--
-- KEYS[1] meta   KEYS[2] next-wake
-- KEYS[3+2r], KEYS[4+2r]   due:RULE and inflight:RULE of rule r (r = 0, 1, ...)
-- ARGV[1] wake channel   ARGV[2] most keys to recover per rule in this call
--
-- Each expired claim goes back to pending, due now, with the attempt it was
-- on counted (a holder that keeps dying reaches the retry limit), merged with
-- any touch that came while it ran. Bounded per call, so it never runs long.
-- Returns {keys recovered}.

local meta, next_key, now = KEYS[1], KEYS[2], now_ms()
local limit, recovered = tonumber(ARGV[2]), 0

for r = 0, (#KEYS - 2) / 2 - 1 do
  local due_key, inflight_key = KEYS[3 + 2 * r], KEYS[4 + 2 * r]
  local expired = redis.call('ZRANGEBYSCORE', inflight_key, '-inf', now, 'LIMIT', 0, limit)
  for _, key in ipairs(expired) do
    local s = decode(redis.call('HGET', meta, key))
    local first, last, attempts = now, now, 0
    if s and s.kind == 'R' then
      first, last, attempts = s.first, s.last, s.attempt
      if s.rdue then first, last = math.min(first, s.rfirst), math.max(last, s.rlast) end
    end
    redis.call('ZREM', inflight_key, key)
    schedule(meta, due_key, key, first, last, attempts, now)
    recovered = recovered + 1
  end
end
if recovered > 0 then wake(next_key, ARGV[1], now) end
return {recovered}
