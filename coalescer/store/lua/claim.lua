#!lua flags=allow-oom
-- claim.lua: the leader claims due keys of one shard into its in-flight sets.
--
-- KEYS[1] leader   KEYS[2] meta   KEYS[3] seq   KEYS[4] next-wake   KEYS[5] nodes
-- KEYS[6] paused (the shard's copy of the paused rules' names)
-- KEYS[7+2r], KEYS[8+2r]   due:RULE and inflight:RULE of rule r (r = 0, 1, ...)
-- ARGV[1] the caller's leader value "EPOCH|NODE-ID"   ARGV[2] claim lease ms
-- ARGV[3] how far ahead the poller looks again at most, ms
-- ARGV[4] node id (kept in each claim)
-- ARGV[5+r] how many keys of rule r to claim at most (0 claims none; -1: the rule is
--          paused: none claimed, and its due keys neither block nor wake the poller).
--          A rule named in KEYS[6] counts as -1 whatever the caller sent: a pause holds
--          against a node that has not heard of it yet.
-- then, only when some rule has items (see _lib.lua): ITEMS-PREFIX, CLAIMED-PREFIX and
-- the items max of each rule r (0: none), from ARGV[5+R] (R rules)
-- then, only when some rule of the call is fair (the items section then always given):
-- "\0FAIR", the fair rules' count and 8 arguments per fair rule (see _fair.lua)
--
-- Checks the caller still holds the shard's leader key, in this same script, so an
-- ex-leader can never claim (the key has no expiry: the lease is the node's, see
-- acquire.lua and node_lease.lua). Claims only keys whose due time has
-- come, lowest first, and gives each a fencing token from the shard's counter. A
-- key whose score is early (a re-touch moved its due time, kept in meta) is
-- re-scored, not claimed.
-- Returns {0} when the caller is not the leader, else
-- {1, now, next due or -1, next lease expiry or -1, live nodes, claims, blocked, held},
-- claims being a list of "RULE-INDEX|TOKEN|FIRST|LAST|ATTEMPT|DUE|KEY" strings (the
-- key last, as it may hold '|'; one string a claim keeps the reply cheap to parse),
-- blocked 1 when a rule claimed as many keys as its limit (0 included), or a fair rule's
-- cap held a group back (_fair.lua), and still
-- has keys due now: they wait for a free slot, or for the next claim when the limit
-- was the per-call cap; its due times are left out of "next due" so other rules
-- are not held up. held lists, for each such rule, "RULE-INDEX|KEYS DUE NOW" (an upper
-- bound: keys re-touched since they were scored count too), then items: one
-- {CLAIM-POSITION (0-based), ITEMS...} per claim of a rule with items that has some
-- ("" among them: the items overflowed).

if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0} end
local now = now_ms()
local lease_until = now + tonumber(ARGV[2])
local live = heartbeat(KEYS[5], ARGV[4], now)
local c = {meta = KEYS[2], seq = KEYS[3], now = now, lease_until = lease_until,
           node = ARGV[4], claims = {}, items = {}}
local rules = (#KEYS - 6) / 2
claim_items_at(c, 5 + rules)
local fair = fair_specs(5 + rules)  -- nil: no rule of this call is fair (_fair.lua)
local paused = paused_due_keys(KEYS[6], KEYS[2])
local published = redis.call('EXISTS', fair_specs_key(KEYS[2])) == 1  -- some rule's index
local next_due, next_expiry = nil, nil

local function head(zset)
  local h = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  return tonumber(h[2])
end

local blocked, held = 0, {}
for r = 0, rules - 1 do
  local due_key, inflight_key = KEYS[7 + 2 * r], KEYS[8 + 2 * r]
  local limit = paused[due_key] and -1 or tonumber(ARGV[5 + r])
  local before = #c.claims
  local capped = false  -- a fair rule's group held back by its cap
  if limit > 0 and fair and fair[r] then
    capped = claim_fair(c, r, due_key, inflight_key, limit, fair[r])
  elseif limit > 0 then
    if published then fair_unpublish(c.meta, due_key) end
    claim_due(c, r, due_key, inflight_key, limit)
  end
  local claimed = #c.claims - before
  local h = limit >= 0 and head(due_key) or nil
  if h and h <= now and (claimed == limit or capped) then
    blocked = 1  -- due work waits for a free slot; it must not delay other rules
    held[#held + 1] = r .. '|' .. redis.call('ZCOUNT', due_key, '-inf', now)
  else
    next_due = min(next_due, h)
  end
  next_expiry = min(next_expiry, head(inflight_key))
end

redis.call('SET', KEYS[4], int(min(next_due, now + tonumber(ARGV[3]))))
return {1, now, next_due or -1, next_expiry or -1, live, c.claims, blocked, held, c.items}
