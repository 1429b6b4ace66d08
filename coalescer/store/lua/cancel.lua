#!lua flags=allow-oom
-- cancel.lua: drop the pending refreshes of keys (one shard, one or more rules).
--
-- KEYS[1] meta   KEYS[2] history   KEYS[3] moving (bundles of keys a reshard's mover
-- took out of this shard and has not deleted, see reshard_take.lua)   KEYS[4] seq
-- KEYS[5+g]      due:RULE of group g (g = 0, 1, ...)
-- ARGV[1] node id (who cancels, for the history)   ARGV[2] history length (0: none)
-- ARGV[3] ITEMS-PREFIX   ARGV[4] CLAIMED-PREFIX (a key's item sets: the prefix and the key)
-- ARGV[5] TRACES-PREFIX (a key's trace contexts: the prefix and the key)
-- then per group g: RULE, N, and its N keys joined by NUL characters in one argument
-- then, optionally, QUIET-PREFIX: each key's quiet marker (QUIET-PREFIX..KEY, see
-- upsert.lua) is deleted whatever state it was found in: its next touch is a quiet
-- key's first again
--
-- Per key, by the state it is found in:
--   pending (backoff included)  its state and its due:RULE entry are deleted, attempts
--                               and all, its items (pending, and a failed try's
--                               kept for its retry), its trace contexts and its
--                               timeline (_lib.lua): "pending"
--   running, touched while it ran  the touch kept to re-arm it (the R* part) is
--                               cleared with the items and the trace contexts
--                               of the touches made while it ran; the
--                               refresh itself goes on (with its claim's items), and its
--                               ack, fail or recovery works as usual with nothing to
--                               re-arm: "rearm"
--   running, nothing to re-arm  left alone: "running"
--   dead                        left alone (coalescer dead purge deletes it): "dead"
--   no state                    "idle" (its timeline deleted); if the key is in
--                               transit (in `moving`), its bundle is returned: the
--                               caller puts it into the key's new shard, and cancels
--                               it there
-- A touch after the cancel arms the key again, as any touch does. Each key whose
-- refresh was dropped ("pending", "rearm") gets a history entry: outcome
-- "cancelled", its rule, the cancelling node, the due time dropped, start = now.
-- Returns {server time ms, {the state found, per key, in ARGV order},
--          this shard's fencing tokens so far, {bundle, ...} of the keys in transit}.

local meta, history = KEYS[1], KEYS[2]
local node, maxlen = ARGV[1], tonumber(ARGV[2])
local items_prefix, claimed_prefix, traces_prefix = ARGV[3], ARGV[4], ARGV[5]
local now = now_ms()

-- Drop one key's pending refresh, or the re-arm of its running one; returns the state
-- it was found in and the due time dropped (nil when nothing was).
local function cancel_one(due_key, key)
  local v = redis.call('HGET', meta, key)
  if not v then
    redis.call('DEL', timeline_of(meta, key))
    return 'idle', nil
  end
  local s = decode(v)
  if s and s.kind == 'D' then return 'dead', nil end
  if s and s.kind == 'R' then
    if not s.rdue then return 'running', nil end
    local due = s.rdue
    s.rdue, s.rfirst, s.rlast = nil, nil, nil
    redis.call('HSET', meta, key, running(s))
    redis.call('DEL', items_prefix .. key, traces_prefix .. key)  -- touched while it ran;
    -- its claim keeps its own items, and its refresh took its own contexts
    return 'rearm', due
  end
  -- pending, or a pending value that does not read (see _lib.lua): gone either way
  redis.call('ZREM', due_key, key)
  redis.call('HDEL', meta, key)
  redis.call('DEL', items_prefix .. key, claimed_prefix .. key, traces_prefix .. key,
             timeline_of(meta, key))
  return 'pending', s and s.due or nil
end

local found, pos, idle = {}, 6, {}
for g = 0, #KEYS - 5 do  -- KEYS[5 + g], from ARGV[6]
  local due_key, rule = KEYS[5 + g], ARGV[pos]
  for _, key in ipairs(split_keys(ARGV[pos + 2], tonumber(ARGV[pos + 1]))) do
    local state, due = cancel_one(due_key, key)
    found[#found + 1] = state
    if state == 'idle' then idle[#idle + 1] = key end
    if state == 'pending' or state == 'rearm' then
      record(history, maxlen, key, rule, node, '', '', due and int(due) or '', now, 0,
             'cancelled')
    end
  end
  pos = pos + 3
end
if ARGV[pos] then  -- QUIET-PREFIX
  local markers = {}
  for at = 6, pos - 1, 3 do
    for _, key in ipairs(split_keys(ARGV[at + 2], tonumber(ARGV[at + 1]))) do
      markers[#markers + 1] = ARGV[pos] .. key
    end
  end
  for i = 1, #markers, CHUNK do
    redis.call('DEL', unpack(markers, i, math.min(i + CHUNK - 1, #markers)))
  end
end
local transit = {}
if #idle > 0 then
  for _, b in ipairs(read_fields(KEYS[3], idle)) do
    if b then transit[#transit + 1] = b end
  end
end
return {now, found, #transit > 0 and tonumber(redis.call('GET', KEYS[4]) or 0) or 0, transit}
