#!lua flags=allow-oom
-- adopt.lua: claim due keys of rules that the shard's leader lacks (a rolling
-- deploy with mixed rules files), for the one live node chosen to serve each.
--
-- KEYS[1] leader   KEYS[2] meta   KEYS[3] seq   KEYS[4] nodes   KEYS[5] rules
-- KEYS[6] paused (the shard's copy of the paused rules' names: each counts as -1)
-- KEYS[7+2r], KEYS[8+2r]   due:RULE and inflight:RULE of rule r (r = 0, 1, ...)
-- ARGV[1] node id   ARGV[2] claim lease ms
-- ARGV[3+2r], ARGV[4+2r]   the name of rule r and how many of its keys to claim
--                          at most (0 claims none; -1: paused, as in claim.lua)
-- then, only when some rule has items: ITEMS-PREFIX, CLAIMED-PREFIX and the items max
-- of each rule (0: none), from ARGV[3+2R] (R rules), as in claim.lua
-- then, only when some rule of the call is fair, its fair section as in claim.lua (the
-- items section then always given): fair rules claim in fair order, caps checked
--
-- A rule is served here only while the shard has a leader, the leader's
-- registry entry lacks the rule, and the caller is the live node with the
-- lowest id that knows it (as in acquire.lua), all checked in this script.
-- Claims exactly as claim.lua does: due keys only, lowest first, each with a
-- fencing token from the shard's counter, so a key is never claimed twice.
-- Returns {now, next due or -1, next lease expiry or -1, claims, blocked,
-- rules served, held}; claims and blocked as in claim.lua, over the rules served;
-- held as in claim.lua: "RULE-INDEX|KEYS DUE NOW" of each rule served that claimed
-- as many keys as its limit (0 included) and still has keys due now; items as in
-- claim.lua.

local node, now = ARGV[1], now_ms()
heartbeat(KEYS[4], node, now)
local holder = redis.call('GET', KEYS[1])
if not holder then return {now, -1, -1, {}, 0, 0} end
local leader = split(holder, 2)[2]
local c = {meta = KEYS[2], seq = KEYS[3], now = now, lease_until = now + tonumber(ARGV[2]),
           node = node, claims = {}, items = {}}
claim_items_at(c, 3 + (#KEYS - 6))
local fair = fair_specs(3 + (#KEYS - 6))  -- nil: no rule of this call is fair (_fair.lua)
local paused = paused_due_keys(KEYS[6], KEYS[2])
local published = redis.call('EXISTS', fair_specs_key(KEYS[2])) == 1  -- some rule's index
local next_due, next_expiry, blocked, served, held = nil, nil, 0, 0, {}

local function head(zset)
  local h = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  return tonumber(h[2])
end

for r = 0, (#KEYS - 6) / 2 - 1 do
  local due_key, inflight_key = KEYS[7 + 2 * r], KEYS[8 + 2 * r]
  local name, limit = ARGV[3 + 2 * r], tonumber(ARGV[4 + 2 * r])
  if paused[due_key] then limit = -1 end
  if adopter_of(KEYS[5], KEYS[4], leader, name) == node then
    served = served + 1
    local before = #c.claims
    local capped = false  -- a fair rule's group held back by its cap
    if limit > 0 and fair and fair[r] then
      capped = claim_fair(c, r, due_key, inflight_key, limit, fair[r])
    elseif limit > 0 then
      if published then fair_unpublish(c.meta, due_key) end
      claim_due(c, r, due_key, inflight_key, limit)
    end
    local h = limit >= 0 and head(due_key) or nil
    if h and h <= now and (limit == 0 or capped) then
      blocked = 1
    else
      next_due = min(next_due, h)
    end
    if h and h <= now and #c.claims - before == limit then
      held[#held + 1] = r .. '|' .. redis.call('ZCOUNT', due_key, '-inf', now)
    end
    next_expiry = min(next_expiry, head(inflight_key))
  end
end
return {now, next_due or -1, next_expiry or -1, c.claims, blocked, served, held, c.items}
