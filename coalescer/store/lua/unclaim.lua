#!lua flags=allow-oom
-- unclaim.lua: give back claims their node will not run, because too few replicas
-- confirmed them (durability: replicas): each one still held under its token goes
-- back to pending, due when it was, with the attempt it was given not counted (a
-- replica away for long never uses up a key's retries), merged with a touch that
-- came since. Items claimed with it stay for the next claim (as in recover.lua).
--
-- KEYS[1] meta   KEYS[2] next-wake
-- KEYS[3+2r], KEYS[4+2r]   due:RULE and inflight:RULE of rule r (r = 0, 1, ...)
-- ARGV[1] wake channel; then per rule r: N, then N pairs KEY TOKEN
-- Returns {keys given back}.

local meta, next_key = KEYS[1], KEYS[2]
local given, earliest, pos = 0, nil, 2

for r = 0, (#KEYS - 2) / 2 - 1 do
  local due_key, inflight_key = KEYS[3 + 2 * r], KEYS[4 + 2 * r]
  local n = tonumber(ARGV[pos])
  for i = pos + 1, pos + 2 * n, 2 do
    local key = ARGV[i]
    local s = held(meta, key, ARGV[i + 1])
    if s then
      local first, last = s.first, s.last
      if s.rdue then first, last = math.min(first, s.rfirst), math.max(last, s.rlast) end
      local due = s.rsched and s.rdue or s.due  -- a time a touch set while it was held
      redis.call('ZREM', inflight_key, key)
      schedule(meta, due_key, key, first, last, math.max(0, s.attempt - 1), due, s.rsched,
               nil, s.rprio)
      earliest = min(earliest, due)
      given = given + 1
    end
  end
  pos = pos + 1 + 2 * n
end
wake(next_key, ARGV[1], earliest)
return {given}
