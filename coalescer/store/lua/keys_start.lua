-- keys_start.lua: where the next page of a sorted set starts, right after a given entry
-- (coalescer keys: a search by capture, or a bulk action, a page at a time).
--
-- KEYS[1] the set (due:RULE, inflight:RULE or dead:RULE of one shard)
-- ARGV[1] the score of the last entry of the page before   ARGV[2] that entry's member
--
-- The set's order is score, then the member's bytes. The answer is the rank of the first
-- entry after (ARGV[1], ARGV[2]): that member's rank + 1 when it is still there with that
-- score; else (removed by an action, claimed, re-scored) the count of the entries below
-- that score plus those of that score whose member sorts before or at ARGV[2], found by
-- a binary search among the entries of that score. O(log N) commands of one entry each:
-- the page itself is read with a plain ZRANGE (store/search_scripts.py), which costs the
-- server far less than returning it from a script. Nothing is written.
-- Returns the rank (0 for the start of the set).

local set, after_score, after_member = KEYS[1], ARGV[1], ARGV[2]

-- a < b in the set's order of members of one score (memcmp order, not the locale's)
local function before(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

local rank = redis.call('ZRANK', set, after_member)
local score = redis.call('ZSCORE', set, after_member)
if rank and tonumber(score) == tonumber(after_score) then return rank + 1 end
local lo = redis.call('ZCOUNT', set, '-inf', '(' .. after_score)
local hi = lo + redis.call('ZCOUNT', set, after_score, after_score)
while lo < hi do  -- the first entry of that score whose member sorts after
  local mid = math.floor((lo + hi) / 2)
  local at = redis.call('ZRANGE', set, mid, mid)[1]
  if before(after_member, at) then hi = mid else lo = mid + 1 end
end
return lo
