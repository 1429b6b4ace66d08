#!lua flags=allow-oom
-- take.lua: claim due keys of one shard for a drain, whoever leads the shard.
--
-- KEYS[1] meta   KEYS[2] seq
-- KEYS[3+2r], KEYS[4+2r]   due:RULE and inflight:RULE of rule r (r = 0, 1, ...)
-- ARGV[1] claim lease ms   ARGV[2] node id (kept in each claim)
-- ARGV[3+r] how many keys of rule r to claim at most (0 claims none)
-- then, only when some rule has items: ITEMS-PREFIX, CLAIMED-PREFIX and the items max
-- of each rule (0: none), from ARGV[3+R] (R rules), as in claim.lua
--
-- Claims exactly as claim.lua does (due keys only, lowest first, one fencing token
-- each from the shard's counter, the same in-flight lease), without the leader
-- check: a drain runs what is due through its own process's handlers. A key that is
-- running is never claimed again, so exclusion holds whoever claims.
-- Returns {now, claims, items}, claims and items as in claim.lua.

local now = now_ms()
local c = {meta = KEYS[1], seq = KEYS[2], now = now, lease_until = now + tonumber(ARGV[1]),
           node = ARGV[2], claims = {}, items = {}}
claim_items_at(c, 3 + (#KEYS - 2) / 2)
for r = 0, (#KEYS - 2) / 2 - 1 do
  local limit = tonumber(ARGV[3 + r])
  if limit > 0 then claim_due(c, r, KEYS[3 + 2 * r], KEYS[4 + 2 * r], limit) end
end
return {now, c.claims, c.items}
