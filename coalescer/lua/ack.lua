-- ack.lua: finish claims whose refresh succeeded (one shard, one or more rules).
--
-- KEYS[1] meta   KEYS[2] next-wake
-- KEYS[3+2g], KEYS[4+2g]   due:RULE and inflight:RULE of group g (g = 0, 1, ...)
-- ARGV[1] wake channel; then per group g: N, then N pairs (key, token)
--
-- A claim is finished only by the holder of its fencing token: an ack that
-- carries an older token (the lease expired and the key was claimed again) is
-- refused and reported, so a paused holder can never ack over a newer claim.
-- A key touched while it ran goes back to pending with its re-armed due time.
-- Returns {acked, re-armed, stale keys...}.

local meta, next_key = KEYS[1], KEYS[2]
local acked, rearmed, stale, earliest, pos = 0, 0, {}, nil, 2

for g = 0, (#KEYS - 2) / 2 - 1 do
  local due_key, inflight_key = KEYS[3 + 2 * g], KEYS[4 + 2 * g]
  local n = tonumber(ARGV[pos])
  for i = pos + 1, pos + 2 * n, 2 do
    local key = ARGV[i]
    local r = held(meta, key, ARGV[i + 1])
    if r then
      redis.call('ZREM', inflight_key, key)
      local due = rearm(meta, due_key, key, r)
      if due then
        rearmed = rearmed + 1
        earliest = min(earliest, due)
      else
        redis.call('HDEL', meta, key)
      end
      acked = acked + 1
    else
      stale[#stale + 1] = key
    end
  end
  pos = pos + 1 + 2 * n
end
wake(next_key, ARGV[1], earliest)
return {acked, rearmed, unpack(stale)}
