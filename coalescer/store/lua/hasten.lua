-- hasten.lua: make pending keys of one shard due now (drain: windows and backoff skipped).
--
-- KEYS[1] meta
-- KEYS[2+2r], KEYS[3+2r]   due:RULE and inflight:RULE of rule r (r = 0, 1, ...)
-- ARGV[1] most keys to hasten per rule in this call
--
-- For up to ARGV[1] pending keys of each rule, lowest score first, sets both the
-- key's score in due:RULE and the DUE of its pending state in meta to the server's
-- now. The score stays a lower bound of DUE (they are equal), as _lib.lua needs.
-- Keys already due now are counted but left as they are. Running, dead and
-- unknown keys are untouched. Wakes no poller: the caller claims what it hastened.
-- Returns {now, keys hastened, keys pending, keys in flight} over the given rules.

local meta, now, limit = KEYS[1], now_ms(), tonumber(ARGV[1])
local hastened, pending_n, inflight_n = 0, 0, 0

local function hasten(due_key, key, score)
  local s = decode(redis.call('HGET', meta, key))
  if s and s.kind == 'P' then
    if s.due <= now and score <= now then return 0 end
    redis.call('HSET', meta, key, pending(s.first, s.last, s.attempts, now, nil, s.count, s.prio))
  elseif score <= now then
    return 0
  end
  due_add(meta, due_key, {now, key}, s and s.prio and {[key] = s.prio})
  return 1
end

for r = 0, (#KEYS - 1) / 2 - 1 do
  local due_key, inflight_key = KEYS[2 + 2 * r], KEYS[3 + 2 * r]
  local keys = redis.call('ZRANGE', due_key, 0, limit - 1, 'WITHSCORES')
  for i = 1, #keys, 2 do
    hastened = hastened + hasten(due_key, keys[i], tonumber(keys[i + 1]))
  end
  pending_n = pending_n + redis.call('ZCARD', due_key)
  inflight_n = inflight_n + redis.call('ZCARD', inflight_key)
end
return {now, hastened, pending_n, inflight_n}
