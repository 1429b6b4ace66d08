-- limits.lua: one shard's count of pending keys, and its dead letters kept within the
-- rules file's limits (their count and their age).
--
-- KEYS[1]        meta hash
-- KEYS[1+r]      due:RULE of rule r (r = 1..R)
-- KEYS[1+R+r]    dead:RULE of rule r
-- ARGV[1] R      ARGV[2] ITEMS-PREFIX   ARGV[3] CLAIMED-PREFIX
-- ARGV[4] the most dead letters this shard keeps (all its rules together)
-- ARGV[5] how long a dead letter is kept, in ms
-- ARGV[6] the most dead letters dropped in this call (the rest go at the next call)
-- ARGV[7] TRACES-PREFIX (a key's trace contexts: the prefix and the key)
--
-- A dead letter older than ARGV[5] is dropped, then the oldest ones (of any rule) while
-- the shard holds more than ARGV[4]. Dropping one is what purge.lua does: its state,
-- its entry, its items, its trace contexts and its timeline go, only if it is still
-- dead.
-- Returns {keys in the due sets (pending, retries in backoff included),
--          dead letters dropped by age, dropped by count, dead letters kept}.

local meta, rules, items_prefix, claimed_prefix = KEYS[1], tonumber(ARGV[1]), ARGV[2], ARGV[3]
local keep, ttl, budget = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local traces_prefix = ARGV[7]
local now = now_ms()

local function drop(dead_key, key)
  redis.call('ZREM', dead_key, key)
  local s = decode(redis.call('HGET', meta, key))
  if s and s.kind == 'D' then
    redis.call('HDEL', meta, key)
    redis.call('DEL', items_prefix .. key, claimed_prefix .. key, traces_prefix .. key,
               timeline_of(meta, key))
  end
  budget = budget - 1
end

local pending, kept, by_age, by_count = 0, 0, 0, 0
for r = 1, rules do
  pending = pending + redis.call('ZCARD', KEYS[1 + r])
  local dead_key = KEYS[1 + rules + r]
  if budget > 0 then
    local old = redis.call('ZRANGEBYSCORE', dead_key, '-inf', '(' .. (now - ttl), 'LIMIT', 0, budget)
    for _, key in ipairs(old) do drop(dead_key, key) end
    by_age = by_age + #old
  end
  kept = kept + redis.call('ZCARD', dead_key)
end

-- the dead set whose oldest letter is the oldest of all, or nil when all are empty
local function oldest()
  local found, at = nil, nil
  for r = 1, rules do
    local head = redis.call('ZRANGE', KEYS[1 + rules + r], 0, 0, 'WITHSCORES')
    if head[1] and (at == nil or tonumber(head[2]) < at) then
      found, at = r, tonumber(head[2])
    end
  end
  return found
end

while kept > keep and budget > 0 do
  local r = oldest()
  if not r then break end
  local dead_key = KEYS[1 + rules + r]
  drop(dead_key, redis.call('ZRANGE', dead_key, 0, 0)[1])
  kept, by_count = kept - 1, by_count + 1
end
return {pending, by_age, by_count, kept}
