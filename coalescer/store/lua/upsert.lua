-- upsert.lua: schedule one batch of touched keys (one shard, one or more rules).
--
-- KEYS[1]   meta hash          KEYS[2]  next-wake string   KEYS[3]  layout marker
-- KEYS[4]   seq (fencing tokens granted so far)
-- KEYS[5]   moving (the bundles of keys taken out of this shard by a reshard's mover
--           and not yet deleted, see reshard_take.lua)
-- KEYS[6]   bytes (the shard's count of bytes held for its keys: this write adds to
--           its "added" field what its new keys and items take, see pending_bytes.lua)
-- KEYS[7+2g], KEYS[8+2g]       due:RULE and dead:RULE of group g (g = 0, 1, ...)
-- ARGV[1]   wake channel       ARGV[2]  the writer's layout generation
-- ARGV[3]   the fencing tokens an old shard had granted when it asked these keys away
--           (0 for other writes): this shard's are raised to it first, so that a key's
--           tokens keep growing when it comes here
-- ARGV ...  per group g, in KEYS order: WINDOW_MS (for a rule with `edge: leading`:
--           "WINDOW_MS|QUIET-PREFIX", see LEADING below), MAX_WAIT_MS, N, the N keys
--           joined by NUL characters in one argument (cheap for the client to send),
--           HELD: 1 for keys of an old shard in a running reshard, written here
--           only if this shard still holds them (else they are "asked": the writer
--           writes them to their new shard), else 0, and TIMES: "" for plain
--           touches, else KEY, TIME, KEY, TIME, ... joined by NUL for the keys of the
--           group touched with a time of their own: "a" and epoch ms, or "d" and a
--           delay in ms from now, then "k" to keep the items the key already had,
--           then "+" when a plain touch followed it. A KEY's TIME may carry a priority:
--           "p" and ms before any "+" ("d5000p30000", or "p30000" alone: a plain
--           touch with a priority); the key's pending state keeps the largest
--           priority its burst's touches gave (see PRIORITY below)
-- then, only when some key was touched with items or a time of its own (an empty
-- section for plain touches):
--   ITEMS-PREFIX, then per rule with items: ITEMS_MAX and one argument of fields
--   joined by NUL: KEY, N, N items, KEY, N, N items, ... (an item "" says that more
--   items than ITEMS_MAX were touched in process: an overflow); each KEY is also
--   among its group's keys, so its touch and its items are written in this one step
--
-- Per key, with t the server time: a new burst is due at t + W; a burst that
-- goes on is due at max(old due, min(t + W, first + M)) (the max keeps a retry
-- backoff), and counts one touch more. A running key records the touch for a re-arm when it finishes. A
-- dead-lettered key starts a new burst with fresh attempts.
-- A touch with a time of its own makes the key due at exactly that time (a past one:
-- now), whatever it was due at, and marks the state (an "S" in front, _lib.lua); it
-- replaces the burst the key had, its pending items too (those touched while it ran,
-- for a running key; its claim keeps its own), unless its time says "k"; a
-- plain touch of a key so marked starts a new burst (due at t + W, first = t) instead
-- of keeping the later due time. A running key keeps such a time for its re-arm.
-- A touch of a key that has a state, in a later second than the burst's last touch or
-- with a time of its own, appends an event to the key's timeline (_lib.lua; its bytes
-- are added) if the key has one (it was claimed in the last hour): a key never claimed
-- costs nothing more (its state tells its burst: first and last touch, count).
-- PRIORITY: a touch with a priority (TIMES above) keeps in the key's pending state the
-- larger of it and the one the state had (_lib.lua); a touch without one keeps the
-- state's. A new burst (a key idle, dead, or claimed since) starts without one; the
-- touches while the key runs keep theirs for its re-arm (the running state's RDUE,
-- _lib.lua). The claim order of _fair.lua reads it.
-- LEADING: a plain touch of a quiet key of a leading rule (no state, a dead one, or a
-- time of its own; and no touch of it within the window before: its marker
-- QUIET-PREFIX..KEY, holding its last touch, is gone or older than the window) is due
-- now (FIRST = DUE). A touch of a key whose leading refresh is not claimed yet (a
-- pending FIRST = DUE) joins it, due as it was. Every other touch is a trailing one, as
-- above (a touch while it runs, too). Each touch of such a rule sets the key's marker to
-- now, expiring a window later (its bytes are added for a new one).
-- A group's states are read with one HMGET and written with one HSET (and one
-- ZADD for the keys its due set must learn): a few commands per group, not per key.
-- A key whose own state cannot be read (a script error while touching it, e.g. a
-- corrupted meta entry) is skipped, and returned with the error, while every other
-- key is scheduled: one bad key never fails the others (the group's new states are
-- worked out before anything is written, so a group that met such a key is worked
-- out again, each key on its own guard). An error reply of a Redis command
-- (READONLY, OOM, WRONGTYPE, ...) is about the server or the shard, not the key: it
-- fails the whole call. A key that failed gets none of its items either.
-- A writer whose layout generation is older than the shard's marker wrote with a
-- mapping that no longer holds: nothing is written, and it reads the layout again.
-- A newer one raises the marker (see store/layout.py).
-- An asked key still in `moving` is in transit: its mover took it and has not
-- deleted it (it may have died, or be slow). Its bundle is returned with it, and the
-- writer puts it into the new shard before its own touch (reshard_put.lua skips a
-- bundle already put), so the new shard never claims the key without the touches
-- and items it had here.
-- Returns {server time ms, keys scheduled, 1 if a poller was woken else 0,
--          {key, error, key, error, ...} of the keys that failed, {asked key, ...},
--          this shard's fencing tokens so far when some key was asked, else 0,
--          {bundle, ...} of the asked keys in transit},
-- or {0, MARKER} for a writer of an older layout.

local meta, next_key, channel = KEYS[1], KEYS[2], ARGV[1]
local gen, marker = tonumber(ARGV[2]), tonumber(redis.call('GET', KEYS[3]) or 1)
if gen < marker then return {0, marker} end
if gen > marker then redis.call('SET', KEYS[3], gen) end
if ARGV[3] ~= '0' and tonumber(redis.call('GET', KEYS[4]) or 0) < tonumber(ARGV[3]) then
  redis.call('SET', KEYS[4], ARGV[3])
end
local now = now_ms()

local function touch_running(r, window, max_wait)
  if r.rsched then  -- a plain touch after a time of its own: a new burst
    r.rfirst, r.rdue, r.rsched = now, now + window, nil
  elseif r.rdue then
    r.rdue = math.max(r.rdue, math.min(now + window, r.rfirst + max_wait))
  else
    r.rfirst, r.rdue = now, now + window
  end
  r.rlast = now
  return running(r)
end

-- The timeline event of a touch now in a burst whose last touch was at `last` (nil: none
-- yet): "t|NOW|BEFORE" when now starts a new second of it, else nil (_lib.lua).
local function new_second(last, before)
  if not last or math.floor(last / 1000) == math.floor(now / 1000) then return nil end
  return 't|' .. int(now) .. '|' .. before
end

-- The new state of a key that has one (`v`), its due time when its due set must
-- learn it (a dead key starting again, a key whose own time a plain touch replaces),
-- else nil: a re-touch moves only the due time kept in meta (see _lib.lua); whether
-- it was dead; and its timeline event (new_second), if any.
local function retouch(v, window, max_wait, prio)
  if not v then  -- a new key touched with a priority
    return pending(now, now, 0, now + window, nil, nil, prio), now + window, false
  end
  local s = decode(v)
  if s.kind == 'R' then
    local ev = new_second(s.rlast, '')
    if prio and prio > (s.rprio or 0) then s.rprio = prio end  -- for its re-arm
    return touch_running(s, window, max_wait), nil, false, ev
  elseif s.kind == 'P' then
    local p = math.max(s.prio or 0, prio or 0)
    if s.sched then
      return pending(now, now, s.attempts, now + window, nil, nil, p), now + window, false
    end
    local due = math.max(s.due or 0, math.min(now + window, s.first + max_wait))
    return pending(s.first, now, s.attempts, due, nil, (s.count or 1) + 1, p), nil, false,
      new_second(s.last, s.count or 1)
  end
  return pending(now, now, 0, now + window, nil, nil, prio), now + window, true
end

-- The due time of a touch's own time `spec` (see TIMES above; a past one is now),
-- and whether a plain touch followed it.
local function spec_due(spec)
  local kind, ms = string.match(spec, '^([ad])(%d+)')
  if not kind then error('bad time ' .. spec) end
  local due = tonumber(ms)
  if kind == 'd' then due = now + due end
  return math.max(due, now), string.sub(spec, -1) == '+'
end

local replaced = {}  -- keys whose burst a time of their own replaced: their items go
local KEY_OVERHEAD, ITEM_OVERHEAD = 80, 16  -- bytes of Redis's own (pending_bytes.lua)
local added = 0  -- bytes of the new keys and items of this write

-- A touch of `v` (false: no state) with its own time `spec`: the new state, its due
-- time (its due set learns it) and whether it was dead (see retouch).
local function timed_state(v, spec, window, max_wait, prio)
  local due, plain_after = spec_due(spec)
  local s = v and decode(v)
  if v and not s then error('unreadable state') end
  if s and s.kind == 'R' then
    s.rfirst, s.rlast, s.rdue, s.rsched = now, now, due, true
    if prio and prio > (s.rprio or 0) then s.rprio = prio end
    if plain_after then return touch_running(s, window, max_wait), nil, false end
    return running(s), nil, false
  end
  local attempts = s and s.kind == 'P' and s.attempts or 0
  local p = math.max(s and s.kind == 'P' and s.prio or 0, prio or 0)
  if plain_after then
    return pending(now, now, attempts, now + window, nil, nil, p), now + window,
      s and s.kind == 'D'
  end
  return pending(now, now, attempts, due, true, nil, p), due, s and s.kind == 'D'
end

-- timed_state, and the timeline event of a touch with its own time of a key that has a
-- state (_lib.lua).
local function timed(v, spec, window, max_wait, prio)
  local state, due, dead_before = timed_state(v, spec, window, max_wait, prio)
  return state, due, dead_before, v and 's|' .. int(now) .. '|' .. int(spec_due(spec)) or nil
end

-- A key's touch: timed when `spec` is given, else a re-touch of its state `v`.
local function touch_key(v, spec, window, max_wait, prio)
  if spec then return timed(v, spec, window, max_wait, prio) end
  return retouch(v, window, max_wait, prio)
end

-- The text of a key's own error; a command's error reply ("CODE message", or a
-- table in some servers) is raised again, code kept, and fails the whole call.
local function key_error(e)
  if type(e) == 'table' then error(e) end
  e = tostring(e)
  if string.match(e, '^%u+ ') then error(redis.error_reply(e)) end
  return e
end

-- `keys` (pending) as SCORE, KEY, ... with their scores in `due_key`: a re-touched key
-- keeps its earlier score there until a claim re-scores it, and its queue entry must not
-- be later (the claim would not take it while the due set says it is due).
local function as_scored(due_key, keys)
  local out = {}
  for from = 1, #keys, 1000 do
    local part = {unpack(keys, from, math.min(from + 999, #keys))}
    local scores = redis.call('ZMSCORE', due_key, unpack(part))
    for j, key in ipairs(part) do
      if scores[j] then out[#out + 1], out[#out + 2] = scores[j], key end
    end
  end
  return out
end

-- Work out the group's writes: p.states (field, value, ...), p.adds (score, key, ...)
-- for its due set, p.revived (dead keys starting again). With `guarded`, each key
-- with a state is worked out under pcall and a failing one goes to `failed`.
-- `times`: key -> its touch's own time (nil when no key of the group has one).
-- `leads`: key -> {state, due, dead} of a leading rule's leading touches (nil: none).
-- `prios`: key -> its touch's priority in ms (nil when no key of the group has one).
-- p.raised: the pending keys whose priority a touch raised (their queue learns it).
local function plan(keys, vals, window, max_wait, guarded, failed, times, leads, prios)
  local states, adds, ns, na = {}, {}, 0, 0  -- counted, not `#`: a long table's # is a search
  local p = {states = states, adds = adds, revived = {}, count = 0, events = {}, lifts = {},
             raised = {}}
  local fresh, fresh_due = pending(now, now, 0, now + window), int(now + window)
  for i = 1, #keys do
    local key, v = keys[i], vals[i]
    local state, due, ok, dead_before, ev = fresh, fresh_due, true, false, nil
    local spec = times and times[key]
    local lead = leads and leads[key]
    local prio = prios and prios[key]
    if lead then
      state, due, dead_before = lead[1], lead[2], lead[3]
      if dead_before then p.revived[#p.revived + 1] = key end
    elseif v or spec or prio then
      if guarded then
        ok, state, due, dead_before, ev = pcall(touch_key, v, spec, window, max_wait, prio)
      else
        state, due, dead_before, ev = touch_key(v, spec, window, max_wait, prio)
      end
      if ok and ev then p.events[#p.events + 1], p.events[#p.events + 2] = key, ev end
      if ok and dead_before then p.revived[#p.revived + 1] = key end
      if ok and spec and v and not string.find(spec, 'k', 2, true) then
        replaced[#replaced + 1] = key
      end
      if ok and spec and due then p.soonest = min(p.soonest, due) end
    end
    if ok then
      if not v then added = added + 2 * #key + #state + KEY_OVERHEAD end
      states[ns + 1], states[ns + 2] = key, state
      ns = ns + 2
      if due then
        adds[na + 1], adds[na + 2] = due, key
        na = na + 2
        if string.find(state, '!', 1, true) then p.lifts[key] = state_prio(state) end
      elseif prio and string.byte(state, 1) ~= 82 then  -- a pending key's priority raised:
        p.raised[#p.raised + 1] = key                    -- its queue learns it (_lib.lua)
        p.lifts[key] = state_prio(state)
      end
    else
      failed[#failed + 1], failed[#failed + 2] = key, key_error(state)
    end
  end
  p.count = ns / 2
  return p
end

-- Every NUL-separated field of `joined`.
local function fields_of(joined)
  local out, start = {}, 1
  while true do
    local stop = string.find(joined, '\0', start, true)
    if not stop then
      out[#out + 1] = string.sub(joined, start)
      return out
    end
    out[#out + 1] = string.sub(joined, start, stop - 1)
    start = stop + 1
  end
end

-- The items section, from ARGV[at]: each key's items into its pending set (_lib.lua).
local function add_touched_items(at, failed)
  local bad, prefix = {}, ARGV[at]
  for i = 1, #failed, 2 do bad[failed[i]] = true end
  for a = at + 1, #ARGV, 2 do
    local max, f, i = tonumber(ARGV[a]), fields_of(ARGV[a + 1]), 1
    while i < #f do
      local key, n = f[i], tonumber(f[i + 1])
      if not bad[key] then
        local items = {}
        for j = 1, n do
          items[j] = f[i + 1 + j]
          added = added + #items[j] + ITEM_OVERHEAD
        end
        add_items(prefix .. key, items, max)
      end
      i = i + 2 + n
    end
  end
end

-- The group's TIMES argument as key -> time and key -> priority ms (see TIMES above),
-- each nil when it has none.
local function times_of(joined)
  if joined == nil or joined == '' then return nil end
  local f, out, prios = fields_of(joined), nil, nil
  for i = 1, #f - 1, 2 do
    local spec = f[i + 1]
    local body, ms, plus = string.match(spec, '^(.-)p(%d+)(%+?)$')
    if body then
      prios = prios or {}
      prios[f[i]] = tonumber(ms)
      spec = body ~= '' and body .. plus or nil
    end
    if spec then
      out = out or {}
      out[f[i]] = spec
    end
  end
  return out, prios
end

-- The keys (and their states) this shard holds: the others are asked.
local function held_only(keys, vals, asked)
  local k, v = {}, {}
  for i = 1, #keys do
    if vals[i] then
      k[#k + 1], v[#v + 1] = keys[i], vals[i]
    else
      asked[#asked + 1] = keys[i]
    end
  end
  return k, v
end

-- LEADING (see above): the leading touches of a leading rule's group, as plan's
-- `leads`, and how many are due now. A key whose state does not read is left to plan.
local function leading_plan(keys, vals, times, window, prefix)
  local leads, maybe, states, due_now = {}, {}, {}, 0
  for i = 1, #keys do
    local key, v = keys[i], vals[i]
    local ok, s = pcall(decode, v)
    if not (times and times[key]) and ok and (s or not v) then
      if not s or s.kind == 'D' or s.sched then
        local n = #maybe + 1
        maybe[n], states[n] = key, s
      elseif s.kind == 'P' and s.due == s.first then
        leads[key] = {pending(s.first, now, s.attempts, s.due, nil, (s.count or 1) + 1)}
      end
    end
  end
  for i = 1, #maybe, CHUNK do
    local part = {}
    for j = i, math.min(i + CHUNK - 1, #maybe) do part[#part + 1] = prefix .. maybe[j] end
    local seen = redis.call('MGET', unpack(part))
    for j = 1, #part do
      local last, s = tonumber(seen[j]), states[i + j - 1]
      if not last then added = added + #part[j] + 16 + KEY_OVERHEAD end
      if not last or now - last >= window then
        local attempts = s and s.kind == 'P' and s.attempts or 0
        leads[maybe[i + j - 1]] = {pending(now, now, attempts, now), now, s and s.kind == 'D'}
        due_now = due_now + 1
      end
    end
  end
  return leads, due_now
end

-- Set the marker of each key a leading rule's group wrote (p.states) to now.
local function mark_touched(states, prefix, window)
  for i = 1, #states, 2 do
    redis.call('SET', prefix .. states[i], now, 'PX', window)
  end
end

local earliest, scheduled, pos, failed, asked = nil, 0, 4, {}, {}
for g = 0, (#KEYS - 6) / 2 - 1 do
  local due_key, dead_key = KEYS[7 + 2 * g], KEYS[8 + 2 * g]
  local window, max_wait = tonumber(ARGV[pos]), tonumber(ARGV[pos + 1])
  local quiet = nil  -- a leading rule's QUIET-PREFIX
  if not window then
    window, quiet = string.match(ARGV[pos], '^(%d+)|(.+)$')
    window = tonumber(window)
  end
  local keys = split_keys(ARGV[pos + 3], tonumber(ARGV[pos + 2]))
  local vals = read_fields(meta, keys)
  if ARGV[pos + 4] == '1' then keys, vals = held_only(keys, vals, asked) end
  local times, prios = times_of(ARGV[pos + 5])
  local leads, due_now = nil, 0
  if quiet then leads, due_now = leading_plan(keys, vals, times, window, quiet) end
  local ok, p = pcall(plan, keys, vals, window, max_wait, false, failed, times, leads, prios)
  if not ok then p = plan(keys, vals, window, max_wait, true, failed, times, leads, prios) end
  if quiet then
    mark_touched(p.states, quiet, window)
    if due_now > 0 then earliest = min(earliest, now) end
  end
  each_chunk('HSET', meta, p.states)
  each_chunk('ZREM', dead_key, p.revived)
  due_add(meta, due_key, p.adds, p.lifts)
  fair_mirror(meta, due_key, as_scored(due_key, p.raised), p.lifts)
  for i = 1, #p.events, 2 do
    local tkey = timeline_of(meta, p.events[i])
    if redis.call('EXISTS', tkey) == 1 then
      timeline_push(tkey, p.events[i + 1])
      added = added + #p.events[i + 1] + ITEM_OVERHEAD
    end
  end
  if #p.adds > 0 then earliest = min(earliest, now + window) end
  earliest = min(earliest, p.soonest)
  scheduled = scheduled + p.count
  pos = pos + 6
end
for i = 1, #asked do failed[#failed + 1], failed[#failed + 2] = asked[i], '' end
if ARGV[pos] then
  for _, key in ipairs(replaced) do redis.call('DEL', ARGV[pos] .. key) end
  add_touched_items(pos, failed)
end
for i = 1, #asked * 2 do failed[#failed] = nil end
if added > 0 then redis.call('HINCRBY', KEYS[6], 'added', added) end
local seq, transit = 0, {}
if #asked > 0 then
  seq = tonumber(redis.call('GET', KEYS[4]) or 0)
  for _, b in ipairs(read_fields(KEYS[5], asked)) do
    if b then transit[#transit + 1] = b end
  end
end
return {now, scheduled, wake(next_key, channel, earliest), failed, asked, seq, transit}
