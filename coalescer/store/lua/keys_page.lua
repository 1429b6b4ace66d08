-- keys_page.lua: one page of a sorted set, from where the page before it ended
-- (coalescer keys: a search by capture, or a bulk action, a page at a time).
--
-- KEYS[1] the set (due:RULE, inflight:RULE or dead:RULE of one shard)
-- ARGV[1] the score of the last entry of the page before ("" for the first page)
-- ARGV[2] that entry's member   ARGV[3] how many entries to return at most
--
-- The page starts right after (ARGV[1], ARGV[2]) in the set's order (score, then the
-- member's bytes): after that member's rank when it is still there with that score;
-- else (removed by an action, claimed, re-scored) at the first entry past it, found by
-- a binary search among the entries of that score. So entries the pages before left
-- in the set are never returned twice and none that stayed in the set is skipped,
-- whatever was removed meanwhile. Cost: O(log N + ARGV[3]); nothing is written.
-- Returns {member, score, member, score, ...} (ZRANGE WITHSCORES, flattened).

local set, after_score, after_member = KEYS[1], ARGV[1], ARGV[2]
local count = tonumber(ARGV[3])

-- a < b in the set's order of members of one score (memcmp order, not the locale's)
local function before(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

local start = 0
if after_score ~= '' then
  local rank = redis.call('ZRANK', set, after_member)
  local score = redis.call('ZSCORE', set, after_member)
  if rank and tonumber(score) == tonumber(after_score) then
    start = rank + 1
  else
    local lo = redis.call('ZCOUNT', set, '-inf', '(' .. after_score)
    local hi = lo + redis.call('ZCOUNT', set, after_score, after_score)
    while lo < hi do  -- the first entry of that score whose member sorts after
      local mid = math.floor((lo + hi) / 2)
      local at = redis.call('ZRANGE', set, mid, mid)[1]
      if before(after_member, at) then hi = mid else lo = mid + 1 end
    end
    start = lo
  end
end
return redis.call('ZRANGE', set, start, start + count - 1, 'WITHSCORES')
