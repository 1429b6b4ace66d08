-- claim.lua: the leader claims due keys of one shard into its in-flight sets.
--
-- KEYS[1] leader   KEYS[2] meta   KEYS[3] seq   KEYS[4] next-wake   KEYS[5] nodes
-- KEYS[6+2r], KEYS[7+2r]   due:RULE and inflight:RULE of rule r (r = 0, 1, ...)
-- ARGV[1] the caller's leader value "EPOCH|NODE-ID"   ARGV[2] leader lease ms
-- ARGV[3] claim lease ms   ARGV[4] longest sleep ms   ARGV[5] node id (kept in each claim)
-- ARGV[6+r] how many keys of rule r to claim at most (0 claims none)
--
-- Checks the caller still holds the shard's lease and renews it, in this same
-- script, so an ex-leader can never claim. Claims only keys whose due time has
-- come, lowest first, and gives each a fencing token from the shard's counter. A
-- key whose score is early (a re-touch moved its due time, kept in meta) is
-- re-scored, not claimed.
-- Returns {0} when the caller is not the leader, else
-- {1, now, next due or -1, next lease expiry or -1, live nodes, claims, blocked},
-- claims being a list of "RULE-INDEX|TOKEN|FIRST|LAST|ATTEMPT|DUE|KEY" strings (the
-- key last, as it may hold '|'; one string a claim keeps the reply cheap to parse),
-- blocked 1 when a rule claimed as many keys as its limit (0 included) and still
-- has keys due now: they wait for a free slot, or for the next claim when the limit
-- was the per-call cap; its due times are left out of "next due" so other rules
-- are not held up.

if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0} end
local leader_lease = tonumber(ARGV[2])
redis.call('PEXPIRE', KEYS[1], leader_lease)
local meta, now = KEYS[2], now_ms()
local lease_until = now + tonumber(ARGV[3])
local live = heartbeat(KEYS[5], ARGV[5], now, 2 * leader_lease)
local claims, next_due, next_expiry = {}, nil, nil

local function head(zset)
  local h = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  return tonumber(h[2])
end

-- Split the keys found due into those really due and those a re-touch moved
-- later (only their meta knows: see _lib.lua); the latter get their true score.
local function sort_out(due_key, ready)
  local take, later = {}, {}
  for i = 1, #ready, 2 do
    local key, score = ready[i], tonumber(ready[i + 1])
    local p = decode(redis.call('HGET', meta, key)) or {first = score, last = score, attempts = 0}
    p.key, p.due = key, p.due or score
    if p.due > now then
      later[#later + 1], later[#later + 2] = p.due, key
    else
      take[#take + 1] = p
    end
  end
  if #later > 0 then redis.call('ZADD', due_key, unpack(later)) end
  return take
end

-- Returns how many keys it claimed.
local function claim_rule(rule_index, due_key, inflight_key, limit)
  local ready = redis.call('ZRANGEBYSCORE', due_key, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
  if #ready == 0 then return 0 end
  redis.call('ZREMRANGEBYRANK', due_key, 0, #ready / 2 - 1)
  local take = sort_out(due_key, ready)
  if #take == 0 then return 0 end
  local token = redis.call('INCRBY', KEYS[3], #take) - #take
  local states, leases = {}, {}
  for i, p in ipairs(take) do
    token = token + 1
    local r = {token = token, first = p.first, last = p.last, attempt = p.attempts + 1, due = p.due,
               node = ARGV[5]}
    states[2 * i - 1], states[2 * i] = p.key, running(r)
    leases[2 * i - 1], leases[2 * i] = lease_until, p.key
    claims[#claims + 1] = table.concat({rule_index, token, int(r.first), int(r.last), r.attempt,
                                        int(r.due), p.key}, '|')
  end
  redis.call('HSET', meta, unpack(states))
  redis.call('ZADD', inflight_key, unpack(leases))
  return #take
end

local blocked = 0
for r = 0, (#KEYS - 5) / 2 - 1 do
  local due_key, inflight_key = KEYS[6 + 2 * r], KEYS[7 + 2 * r]
  local limit = tonumber(ARGV[6 + r])
  local claimed = 0
  if limit > 0 then claimed = claim_rule(r, due_key, inflight_key, limit) end
  local h = head(due_key)
  if h and h <= now and claimed == limit then
    blocked = 1  -- due work waits for a free slot; it must not delay other rules
  else
    next_due = min(next_due, h)
  end
  next_expiry = min(next_expiry, head(inflight_key))
end

redis.call('SET', KEYS[4], int(min(next_due, now + tonumber(ARGV[4]))))
return {1, now, next_due or -1, next_expiry or -1, live, claims, blocked}
