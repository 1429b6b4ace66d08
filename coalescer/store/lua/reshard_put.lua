-- reshard_put.lua: put keys taken by reshard_take.lua into their new shard.
--
-- KEYS[1] meta   KEYS[2] seq   KEYS[3] next-wake string   KEYS[4] rulenames
-- KEYS[5] arrived (HASH key -> the id of the last bundle of it put here)
-- ARGV[1] wake channel   ARGV[2] the shard's key prefix
-- ARGV[3] the old shard's fencing tokens so far (this shard's are raised to it, so a
--         key's tokens keep growing across its move)
-- ARGV[4...] BUNDLE, BUNDLE, ... (JSON, see reshard_take.lua), each with its key as
--         field `k`
--
-- A key this shard already holds was touched here while it moved (a writer found it
-- gone from its old shard): the two merge as one burst would. Pending and pending:
-- first and last touch widen, the later due time and the higher attempt count win, and
-- their touches add up; the due time kept keeps its mark of a touch's own time, and
-- the larger priority is kept (_lib.lua).
-- Pending into running: a re-arm for when the run ends. Pending into dead: pending
-- again. A dead bundle into a key with a state: dropped (the newer touch revived it).
-- Items go to the key's items and claimed items (a failed try's) to its claimed items,
-- as they were in the old shard: its next claim gets them all, and a touch with a time
-- of its own replaces only the former (upsert.lua). Into a running key both go to its
-- items (its claimed items are its run's): its re-arm's claim gets them.
-- A bundle already put (its mover died before deleting it from the old shard) is
-- skipped: `arrived` holds the id of the last bundle put per key, for as long as the
-- reshard runs.
-- Returns the number of bundles put (not skipped).

local meta = KEYS[1]
local prefix, earliest = ARGV[2], nil
if tonumber(redis.call('GET', KEYS[2]) or 0) < tonumber(ARGV[3]) then
  redis.call('SET', KEYS[2], ARGV[3])
end

local function merge_pending(b, e, due_key, key)
  local first, last = math.min(b.first, e.first), math.max(b.last, e.last)
  local due = math.max(b.due, e.due)
  local sched = (b.due == due and b.sched) or (e.due == due and e.sched) or nil
  local prio = math.max(b.prio or 0, e.prio or 0)
  redis.call('HSET', meta, key, pending(first, last, math.max(b.attempts, e.attempts), due,
                                        sched, (b.count or 1) + (e.count or 1), prio))
  due_add(meta, due_key, {due, key}, {[key] = prio})
  return due
end

local function rearm_running(b, r, key)
  r.rfirst = r.rfirst and math.min(r.rfirst, b.first) or b.first
  r.rlast = math.max(r.rlast or 0, b.last)
  if b.due >= (r.rdue or 0) then r.rsched = b.sched end
  r.rdue = math.max(r.rdue or 0, b.due)
  r.rprio = math.max(r.rprio or 0, b.prio or 0)
  redis.call('HSET', meta, key, running(r))
end

-- Put one pending bundle `b` (decoded state) of `key`; returns its due time.
local function put_pending(key, b, e, rule)
  local due_key = prefix .. ':due:' .. rule
  if e and e.kind == 'P' then return merge_pending(b, e, due_key, key) end
  if e and e.kind == 'R' then return rearm_running(b, e, key) end
  if e and e.kind == 'D' then redis.call('ZREM', prefix .. ':dead:' .. rule, key) end
  schedule(meta, due_key, key, b.first, b.last, b.attempts, b.due, b.sched, b.count, b.prio)
  return b.due
end

local function put(bundle)
  local key, v, rule = bundle.k, bundle.v, bundle.r
  if redis.call('HGET', KEYS[5], key) == bundle.id then return 0 end
  redis.call('HSET', KEYS[5], key, bundle.id)
  local b, ev = decode(v), redis.call('HGET', meta, key)
  local e = decode(ev)
  if rule ~= '' then redis.call('SADD', KEYS[4], rule) end
  if b and b.kind == 'P' and rule ~= '' then
    earliest = min(earliest, put_pending(key, b, e, rule))
  elseif not ev then
    redis.call('HSET', meta, key, v)
    if rule ~= '' and bundle.z ~= '' then
      redis.call('ZADD', prefix .. ':dead:' .. rule, bundle.z, key)
    end
  end
  local items, claimed = prefix .. ':items:' .. key, prefix .. ':claimed:' .. key
  if e and e.kind == 'R' then claimed = items end  -- its claim's set is its run's own
  if #bundle.i > 0 then each_chunk('SADD', items, bundle.i) end
  if #bundle.c > 0 then each_chunk('SADD', claimed, bundle.c) end
  return 1
end

local n = 0
for i = 4, #ARGV do n = n + put(cjson.decode(ARGV[i])) end
wake(KEYS[3], ARGV[1], earliest)
return n
