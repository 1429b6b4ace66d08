#!lua flags=allow-oom
-- renew.lua: extend the leases of claims that are still running on this node.
--
-- KEYS[1] meta;  KEYS[2+g]  inflight:RULE of group g (g = 0, 1, ...)
-- ARGV[1] claim lease ms; then per group g: N, then N pairs (key, token)
--
-- A lease is extended only for the holder of the claim's fencing token.
-- Returns the keys whose claim this node no longer holds (their handlers
-- should stop: another node may already run them).

local meta, now = KEYS[1], now_ms()
local until_ms = now + tonumber(ARGV[1])
local lost, pos = {}, 2

for g = 0, #KEYS - 2 do
  local inflight_key = KEYS[2 + g]
  local n = tonumber(ARGV[pos])
  for i = pos + 1, pos + 2 * n, 2 do
    local key = ARGV[i]
    if held(meta, key, ARGV[i + 1]) then
      redis.call('ZADD', inflight_key, 'XX', until_ms, key)
    else
      lost[#lost + 1] = key
    end
  end
  pos = pos + 1 + 2 * n
end
return lost
