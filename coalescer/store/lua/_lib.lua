-- _lib.lua: helpers prepended to every script by script_calls.py.
--
-- A key's state lives in the shard's meta hash, one field per touched key:
--   pending  "FIRST|DUE|LAST|ATTEMPTS"  (the key is in due:RULE) with FIRST in
--            lowercase hex and DUE and LAST as decimal offsets from FIRST; LAST
--            and ATTEMPTS are left out while zero, LAST too when ATTEMPTS is
--            ("18e2a4c1f00|500" is a key touched once, due 500 ms later): short
--            values keep a pending key small, most of the memory a shard uses.
--            A fifth field, COUNT, counts the burst's touches once there are two
--            ("18e2a4c1f00|500|120|0|3"): LAST and ATTEMPTS are then written even
--            when zero. A touch counts once per write to Redis (touches of one key
--            that a process absorbs before its flush count as one).
--            An older "P|FIRST|LAST|ATTEMPTS|DUE" still decodes.
--            "!PRIORITY" at the end (base 36 ms) is the burst's priority, the largest
--            its touches gave (upsert.lua; none: no "!"): "18e2a4c1f00|500!n5c" is
--            due 500 ms after FIRST, claimed among due keys as if due 30 s earlier.
--            "S" before it marks a due time set by a touch's own time (upsert.lua):
--            the next plain touch replaces it instead of keeping the later of the two.
--            Its FIRST and DUE offset are written in base 36 ("Smx966f40|16v7k00" is
--            due 30 days after FIRST): at most 17 characters up to 2 years ahead,
--            which keeps a scheduled key's entry in the hash as small as a
--            short pending one's.
--   running  "R|TOKEN|FIRST|LAST|ATTEMPT|DUE|RDUE|RFIRST|RLAST|NODE"
--            (the key is in inflight:RULE; the R* part, empty when there is
--            none, is a touch that came while it ran, re-armed by ack, fail or
--            recovery; RDUE is "S"-prefixed when that touch had a time of its own, and
--            followed by "!PRIORITY" when the touches gave one (as a pending state's); NODE, last as it may hold '|', is the node that claimed
--            it. An older "R|TOKEN|FIRST|LAST|ATTEMPT|DUE[|RDUE|RFIRST|RLAST]"
--            still decodes, with no node)
--   dead     "D|FIRST|LAST|ATTEMPTS|ERROR"   (the key is in dead:RULE)
-- FIRST and LAST are the burst's first and last touch, server-clock ms;
-- ATTEMPTS counts the tries made so far, ATTEMPT the one running now.
--
-- A pending key's DUE is the truth; its score in due:RULE is a lower bound. A
-- re-touch moves only DUE (HGET + HSET: constant time however many keys are
-- pending), and claim.lua re-scores a key it finds early instead of claiming it.
-- Due times only ever grow while a key is pending, so the bound holds; a touch with
-- a time of its own (which may move DUE earlier) re-scores the key itself.

local CHUNK = 4000  -- values per unpack(): well within Lua's stack

-- One command per few thousand `items` (members, or field-value pairs): CMD KEY ITEMS...
local function each_chunk(cmd, key, items)
  for i = 1, #items, CHUNK do
    redis.call(cmd, key, unpack(items, i, math.min(i + CHUNK - 1, #items)))
  end
end

-- The values of `fields` in hash `hash` (false where absent), HMGET a few thousand at once.
local function read_fields(hash, fields)
  if #fields <= CHUNK then return redis.call('HMGET', hash, unpack(fields)) end
  local out = {}
  for i = 1, #fields, CHUNK do
    local part = redis.call('HMGET', hash, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
    for j = 1, #part do out[i + j - 1] = part[j] end
  end
  return out
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function int(x)
  return string.format('%d', x)
end

-- The `n` keys of one argument, joined by NUL characters (no key holds a NUL).
local function split_keys(joined, n)
  local keys, start = {}, 1
  for i = 1, n do
    local stop = string.find(joined, '\0', start, true) or (#joined + 1)
    keys[i] = string.sub(joined, start, stop - 1)
    start = stop + 1
  end
  return keys
end

local function split(v, n)
  local out, pos = {}, 1
  for i = 1, n - 1 do
    local bar = string.find(v, '|', pos, true)
    if not bar then
      out[i] = string.sub(v, pos)
      return out
    end
    out[i] = string.sub(v, pos, bar - 1)
    pos = bar + 1
  end
  out[n] = string.sub(v, pos)
  return out
end

local function decode_running(v)
  local t, f, l, a, d, rd, rf, rl, node = string.match(
    v, '^R|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(S?%d*!?[%da-z]*)|(%d*)|(%d*)|(.*)$')
  if not t then  -- the older form, without the node
    local o = split(string.sub(v, 3), 8)
    t, f, l, a, d, rd, rf, rl = o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8]
  end
  local sched = rd ~= nil and string.sub(rd, 1, 1) == 'S'
  if sched then rd = string.sub(rd, 2) end
  local rprio = nil  -- the re-arm's priority: "!" and base 36 ms after RDUE
  local bang = rd and string.find(rd, '!', 1, true)
  if bang then rd, rprio = string.sub(rd, 1, bang - 1), tonumber(string.sub(rd, bang + 1), 36) end
  return {kind = 'R', token = tonumber(t), first = tonumber(f), last = tonumber(l),
          attempt = tonumber(a), due = tonumber(d), rdue = tonumber(rd),
          rfirst = tonumber(rf), rlast = tonumber(rl), node = node, rsched = sched or nil,
          rprio = rprio}
end

local B36 = '0123456789abcdefghijklmnopqrstuvwxyz'

-- `n` (a whole number) in base 36, lowercase.
local function b36(n)
  if n < 0 then return '-' .. b36(-n) end
  local out = ''
  repeat
    local d = n % 36
    out = string.sub(B36, d + 1, d + 1) .. out
    n = (n - d) / 36
  until n == 0
  return out
end

local function from_b36(s)
  if string.sub(s, 1, 1) == '-' then return -tonumber(string.sub(s, 2), 36) end
  return tonumber(s, 36)
end

-- FIRST, DUE, LAST, ATTEMPTS, COUNT and PRIORITY (ms, 0: none) of a pending value of the
-- short form (FIRST and its DUE offset in base 36 after an "S"), else nil (a running or
-- dead value never reads as one: its letter is not lowercase hex, nor S).
local function short_pending(v)
  local first, due, last, attempts, count, prio
  if string.byte(v, 1) == 83 then  -- "S"
    first, due, last, attempts, count, prio = string.match(
      v, '^S([%da-z]+)|(%-?[%da-z]+)|?(%-?%d*)|?(%d*)|?(%d*)(!?[%da-z]*)$')
    if not first then return nil end
    first, due = tonumber(first, 36), from_b36(due)
  else
    first, due, last, attempts, count, prio = string.match(
      v, '^([%da-f]+)|(%-?%d+)|?(%-?%d*)|?(%d*)|?(%d*)(!?[%da-z]*)$')
    if not first then return nil end
    first, due = tonumber(first, 16), tonumber(due)
  end
  return first, first + due, first + (tonumber(last) or 0), tonumber(attempts) or 0,
    tonumber(count) or 1, prio ~= '' and tonumber(string.sub(prio, 2), 36) or 0
end

local function decode(v)
  if not v then return nil end
  local kind = string.sub(v, 1, 1)
  if kind == 'R' then return decode_running(v) end
  if kind == 'D' or kind == 'P' then
    local f = split(string.sub(v, 3), 4)
    if kind == 'D' then
      return {kind = 'D', first = tonumber(f[1]), last = tonumber(f[2]),
              attempts = tonumber(f[3]), error = f[4]}
    end
    local p = {kind = 'P', first = tonumber(f[1]), last = tonumber(f[2]),
               attempts = tonumber(f[3]), due = tonumber(f[4])}
    if p.first and p.last and p.attempts and p.due then return p end
    return nil  -- unreadable: see below
  end
  -- A pending value that does not read (corrupted by hand) decodes as nil: the claim
  -- script then claims the key as touched now (its ack writes a good state), and
  -- upsert.lua reports the key as one it cannot touch.
  local first, due, last, attempts, count, prio = short_pending(v)
  if not first then return nil end
  return {kind = 'P', first = first, due = due, last = last, attempts = attempts,
          count = count, sched = kind == 'S' or nil, prio = prio}
end

-- FIRST, DUE, LAST, ATTEMPTS and COUNT of a pending value `v`, without a table
-- (claim.lua reads thousands a call); a value that does not read (see decode) is a key
-- touched once at `now`.
local function pending_times(v, now)
  local first, due, last, attempts, count = short_pending(v or '')
  if first then return first, due, last, attempts, count end
  local p = decode(v)
  if p and p.kind == 'P' then return p.first, p.due, p.last, p.attempts, 1 end
  return now, now, now, 0, 1
end

-- THE FAIR INDEX of a rule with `fair:` or a priority (_fair.lua keeps its order): its
-- claim publishes, in its shard's FAIR-SPECS hash (the meta key's name and ":fair",
-- keys.py ShardKeys.fair_specs), due key -> "PATTERN\0PREFIX\0PRIORITY-MS". Every
-- script that adds keys to a due set goes through due_add, which mirrors those due
-- within FAIR_AHEAD ms into the index: each key into its group's queue PREFIX..q:GROUP
-- at its due score, and its group into PREFIX..heads (group -> its earliest score)
-- unless the order holds it already (PREFIX..groups); a key whose priority is above the
-- rule's also into PREFIX..prio (key -> due score), which the claim moves up its queue
-- once it is due. A key due later costs no index while it waits: the claim indexes it
-- from the due set when it comes within FAIR_AHEAD of its due time (_fair.lua).
local FAIR_AHEAD = 60000
local fair_specs_read = {}  -- due key -> spec, or false: read once a call

-- The shard's FAIR-SPECS hash, named after its meta hash as keys.py names it.
local function fair_specs_key(meta)
  return meta .. ':fair'
end

local function fair_spec_of(meta, due_key)
  local f = fair_specs_read[due_key]
  if f == nil then
    f = false
    local v = redis.call('HGET', fair_specs_key(meta), due_key)
    if v then
      local pattern, prefix, prio = string.match(v, '^(.-)%z(.-)%z(%d+)$')
      if prefix then f = {pattern = pattern, prefix = prefix, prio = tonumber(prio)} end
    end
    fair_specs_read[due_key] = f
  end
  return f
end

-- The priority (ms) a key's state carries ("!" and base 36 at its end), or 0.
local function state_prio(v)
  if not v or not string.find(v, '!', 1, true) then return 0 end
  local p = string.match(v, '!([%da-z]+)$')
  return p and tonumber(p, 36) or 0
end

-- Mirror `entries` (SCORE, KEY, ... just added to `due_key`) into the rule's fair index
-- (see above); `prios`: key -> its priority ms, or nil.
local function fair_mirror(meta, due_key, entries, prios)
  local f = fair_spec_of(meta, due_key)
  if not f or #entries == 0 then return end
  local by, order, lifted, horizon = {}, {}, {}, now_ms() + FAIR_AHEAD
  for i = 1, #entries, 2 do
    local score, key = tonumber(entries[i]), entries[i + 1]
    local g = score <= horizon and (string.match(key, f.pattern) or '')
    local t = g and by[g]
    if g and not t then
      t = {n = 0, low = score, items = {}}
      by[g] = t
      order[#order + 1] = g
    end
    if t then
      t.items[t.n + 1], t.items[t.n + 2], t.n = score, key, t.n + 2
      if score < t.low then t.low = score end
      if prios and (prios[key] or 0) > f.prio then
        lifted[#lifted + 1], lifted[#lifted + 2] = score, key
      end
    end
  end
  for _, g in ipairs(order) do
    each_chunk('ZADD', f.prefix .. 'q:' .. g, by[g].items)
    if not redis.call('ZSCORE', f.prefix .. 'groups', g) then
      redis.call('ZADD', f.prefix .. 'heads', 'LT', by[g].low, g)
    end
  end
  each_chunk('ZADD', f.prefix .. 'prio', lifted)
end

-- Add `entries` (SCORE, KEY, ...) to `due_key`, and to its rule's fair index.
local function due_add(meta, due_key, entries, prios)
  each_chunk('ZADD', due_key, entries)
  fair_mirror(meta, due_key, entries, prios)
end

-- A pending value (`sched`: the due time is a touch's own, see above; `count`: the
-- burst's touches, 1 when nil; `prio`: the burst's priority in ms, none when nil or 0).
local function pending(first, last, attempts, due, sched, count, prio)
  local v
  if sched then
    v = 'S' .. b36(first) .. '|' .. b36(due - first)
  else
    v = string.format('%x|%d', first, due - first)
  end
  if count and count > 1 then
    v = v .. string.format('|%d|%d|%d', last - first, attempts, count)
  elseif attempts > 0 then
    v = v .. string.format('|%d|%d', last - first, attempts)
  elseif last ~= first then
    v = v .. string.format('|%d', last - first)
  end
  if prio and prio > 0 then return v .. '!' .. b36(prio) end
  return v
end

-- Make `key` pending, due at `due`, in meta and in its rule's due set (`sched`: a
-- due time set by a touch's own time; `count`: the burst's touches, 1 when nil).
local function schedule(meta, due_key, key, first, last, attempts, due, sched, count, prio)
  redis.call('HSET', meta, key, pending(first, last, attempts, due, sched, count, prio))
  due_add(meta, due_key, {due, key}, prio and {[key] = prio})
end

local function running(r)
  local v = 'R|' .. int(r.token) .. '|' .. int(r.first) .. '|' .. int(r.last) .. '|'
    .. int(r.attempt) .. '|' .. int(r.due)
  if r.rdue then
    local p = r.rprio and r.rprio > 0 and '!' .. b36(r.rprio) or ''
    v = v .. '|' .. (r.rsched and 'S' or '') .. int(r.rdue) .. p .. '|' .. int(r.rfirst)
      .. '|' .. int(r.rlast)
  else
    v = v .. '|||'
  end
  return v .. '|' .. (r.node or '')
end

local function dead(first, last, attempts, err)
  return 'D|' .. int(first) .. '|' .. int(last) .. '|' .. int(attempts) .. '|' .. err
end

-- The running claim of `key` if its token is `token`, else nil (a stale holder).
local function held(meta, key, token)
  local r = decode(redis.call('HGET', meta, key))
  if r and r.kind == 'R' and r.token == tonumber(token) then return r end
  return nil
end

-- Put a finished claim back to pending with its re-armed touch, if it has one.
-- Returns the new due time, or nil when nothing was touched while it ran.
local function rearm(meta, due_key, key, r)
  if not r.rdue then return nil end
  schedule(meta, due_key, key, r.rfirst, r.rlast, 0, r.rdue, r.rsched, nil, r.rprio)
  return r.rdue
end

-- Tell a sleeping poller about a due time nearer than the one it sleeps to.
local function wake(next_key, channel, earliest)
  if not earliest then return 0 end
  local planned = tonumber(redis.call('GET', next_key))
  if planned and planned <= earliest then return 0 end
  redis.call('SET', next_key, int(earliest))
  redis.call('PUBLISH', channel, int(earliest))
  return 1
end

local function min(a, b)
  if not a then return b end
  if not b then return a end
  return math.min(a, b)
end

-- Record a node in the shard's node set (score: when it was last heard of here); returns
-- the set's size. A node leaves the set when it shuts down (release.lua) or, once its node
-- lease lapsed (node_lease.lua), when a live node forgets it: never by the age of its entry,
-- as an idle node calls no shard's script for as long as it stays idle.
local function heartbeat(nodes_key, node, now)
  redis.call('ZADD', nodes_key, now, node)
  return redis.call('ZCARD', nodes_key)
end

-- The rules registry of a shard (keys.py): node id -> "|NAME=FP|NAME=FP|". An
-- entry counts only while its node is in the shard's live-node set.
local function knows(entry, name)
  return entry and string.find(entry, '|' .. name .. '=', 1, true) ~= nil
end

-- Drop the registry entries of nodes that left the live-node set.
local function prune_rules(rules_key, nodes_key)
  local gone = {}
  for _, node in ipairs(redis.call('HKEYS', rules_key)) do
    if not redis.call('ZSCORE', nodes_key, node) then gone[#gone + 1] = node end
  end
  if #gone > 0 then redis.call('HDEL', rules_key, unpack(gone)) end
end

-- Who serves rule `name` on this shard besides its leader: nil when the leader
-- (node id `leader`) knows the rule, else the live node with the lowest id that
-- knows it (nil when none does). A leader that registered no rules (a version
-- without the registry) is taken to know them all: a lease holder is never
-- second-guessed without evidence.
local function adopter_of(rules_key, nodes_key, leader, name)
  local entry = redis.call('HGET', rules_key, leader)
  if not entry or knows(entry, name) then return nil end
  local best, all = nil, redis.call('HGETALL', rules_key)
  for i = 1, #all, 2 do
    local node = all[i]
    if (not best or node < best) and knows(all[i + 1], name)
        and redis.call('ZSCORE', nodes_key, node) then
      best = node
    end
  end
  return best
end

-- Items (a rule with items: {max}, keys.py): the items touched with a key wait in
-- the set ITEMS-PREFIX..KEY; a claim of the key moves them into CLAIMED-PREFIX..KEY,
-- merged with what is there (the items of a try that failed, or whose holder died),
-- where they stay until a success is acked: a retry, a claim taken over after a lost
-- lease and a dead letter's retry get them again. The member "" (never an item: an
-- item is not empty) says items overflowed: past `max` a set stops growing. A script
-- that drops a key's state for good (purge.lua) deletes both sets. Rules without
-- items never touch them: the claiming scripts read an items section of ARGV only
-- when one is given (see claim_items_at).
local OVERFLOW = ''

-- Add `items` (a list; "" for an overflow seen in process) to `set`, which holds at
-- most `max` items: past that, the new ones are left out and "" goes in instead.
local function add_items(set, items, max)
  local n = redis.call('SCARD', set)
  if n + #items <= max then  -- room for every one: the usual case
    each_chunk('SADD', set, items)
    return
  end
  local room = max - n + redis.call('SISMEMBER', set, OVERFLOW)
  local new, over = {}, false
  for i = 1, #items, CHUNK do
    local last = math.min(i + CHUNK - 1, #items)
    local has = redis.call('SMISMEMBER', set, unpack(items, i, last))
    for j = i, last do
      local item = items[j]
      if item == OVERFLOW then
        over = true
      elseif has[j - i + 1] == 0 then
        if room > 0 then new[#new + 1], room = item, room - 1 else over = true end
      end
    end
  end
  if over then new[#new + 1] = OVERFLOW end
  each_chunk('SADD', set, new)
end

-- Move a claimed key's pending items into its claimed set (merged with what a failed
-- try left there), at most `max` of them (past it, some go and "" says so); returns
-- the claimed set's members. The bound is checked whatever the sets held: a live
-- reshard's move may have joined a failed try's items from the old shard to another's.
local function take_items(pending_key, claimed_key, max)
  if redis.call('EXISTS', pending_key) == 1 then
    if redis.call('EXISTS', claimed_key) == 0 then
      redis.call('RENAME', pending_key, claimed_key)
    else
      redis.call('SUNIONSTORE', claimed_key, claimed_key, pending_key)
      redis.call('DEL', pending_key)
    end
  end
  local n = redis.call('SCARD', claimed_key)
  if n > max then  -- ("" counts in n: it is taken out and put back)
    local over = redis.call('SREM', claimed_key, OVERFLOW)
    local extra = n - over - max
    if extra > 0 then
      redis.call('SPOP', claimed_key, extra)
      over = 1
    end
    if over > 0 then redis.call('SADD', claimed_key, OVERFLOW) end
  end
  return redis.call('SMEMBERS', claimed_key)
end

-- The optional items section of a claiming script's ARGV, from `at`: ITEMS-PREFIX,
-- CLAIMED-PREFIX, then each rule's items max in rule order (0: the rule has none).
-- Sets c.items_at (nil without a section: then no rule has items).
local function claim_items_at(c, at)
  if ARGV[at] then
    c.items_prefix, c.claimed_prefix, c.items_at = ARGV[at], ARGV[at + 1], at + 2
  end
end

-- Hand the claims of a rule with items their items: `take` holds the claims'
-- FIRST|LAST|ATTEMPT|DUE and key pairs (claim_due), the first of them at 0-based
-- position `before` in c.claims. Appends {CLAIM-POSITION, MEMBERS...} to c.items for
-- each claim whose set is not empty.
local function claim_items(c, rule_index, take, n, before)
  local max = c.items_at and tonumber(ARGV[c.items_at + rule_index]) or 0
  if max <= 0 then return end
  local pos, out = before, c.items
  for i = 2, n, 2 do
    local key = take[i]
    local members = take_items(c.items_prefix .. key, c.claimed_prefix .. key, max)
    if #members > 0 then
      local entry = {pos}
      for j = 1, #members do entry[j + 1] = members[j] end
      out[#out + 1] = entry
    end
    pos = pos + 1
  end
end

-- Fencing tokens. A token must be above every token handed out before for its key,
-- whatever failover happened: a replica promoted after lagging holds a counter that
-- missed the last claims, and a plain counter would hand their tokens out again.
-- So a token is the larger of the shard's counter + 1 and the server clock in ms
-- times TOKEN_TICKS (2^11): after a failover the new primary's clock has moved on
-- (a failover takes longer than the clocks of primary and replica differ), so its
-- first token is above every token of before, counter behind or not; between
-- failovers the counter keeps tokens strictly growing even if the clock steps back,
-- and more than TOKEN_TICKS claims in one millisecond just run ahead of the clock.
-- A token stays a whole number below 2^53 (exact in Lua, JSON and JavaScript) until
-- the year 2109. Tokens from before this rule (small counter values) are all below
-- the clock's, so an upgrade keeps them growing too. The counter holds the last
-- token handed out (seq: what upsert, cancel and a reshard read and carry).
local TOKEN_TICKS = 2048

-- Take `count` tokens from the shard's counter `seq_key` at server time `now`;
-- returns the token before the first of them (the caller adds 1 per claim).
local function take_tokens(seq_key, count, now)
  local last = tonumber(redis.call('GET', seq_key) or 0)
  local first = math.max(last + 1, now * TOKEN_TICKS)
  redis.call('SET', seq_key, int(first + count - 1))
  return first - 1
end

-- Timelines (keys.py ShardKeys.timeline, read by query/timeline.py): a key's recent
-- events, a LIST "PREFIX:timeline:KEY" of at most TIMELINE_EVENTS strings, oldest first,
-- that expires TIMELINE_KEEP_MS after its last event. The events, fields joined by "|":
--   t|MS|BEFORE    a touch in a new second of the burst (upsert.lua): BEFORE is the
--                  burst's touch count before it ("" for a key that was running); a
--                  burst's first touch and the touches within a second write nothing
--   s|MS|DUE       a touch with a time of its own (at/delay) of a key with a state
--                  (upsert.lua writes these two only to a timeline that exists: a key
--                  gets one at its first claim)
--   c|MS|TOKEN|FIRST|LAST|ATTEMPT|DUE|COUNT|ITEMS|NODE   a claim (claim_keys): DUE with
--                  an "S" in front when a touch's own time set it, COUNT the burst's
--                  touches, ITEMS the claim's items ("" without items; "+" after the
--                  number when they overflowed); NODE last (it may hold "|")
--   o|MS|TOKEN|OUTCOME|START|DURATION|BATCH|NEXT|ERROR   a claim finished (ack.lua,
--                  fail.lua): OUTCOME success, failure, timeout or lost; NEXT
--                  "again@DUE" (touched while it ran), "retry@DUE", "dead" or ""
-- Whatever deletes a key's state for good (cancel, purge, the dead-letter trim) deletes
-- its timeline; an ack leaves it to expire.
local TIMELINE_EVENTS, TIMELINE_KEEP_MS = 32, 3600000

-- The timeline key of `key` in the shard of `meta_key` (a shard's keys share the prefix
-- of "PREFIX:meta", as paused_due_keys reads it too).
local function timeline_of(meta_key, key)
  return string.sub(meta_key, 1, #meta_key - 4) .. 'timeline:' .. key
end

-- Append `event` to the timeline `tkey` (trimmed to its last TIMELINE_EVENTS, expiry
-- moved); returns the timeline's length before any trim.
local function timeline_push(tkey, event)
  local n = redis.call('RPUSH', tkey, event)
  if n > TIMELINE_EVENTS then redis.call('LTRIM', tkey, -TIMELINE_EVENTS, -1) end
  redis.call('PEXPIRE', tkey, TIMELINE_KEEP_MS)
  return n
end

-- The claims of one claim_keys call on their keys' timelines: `take`, `counts` and
-- `sched` (claims due at a touch's own time) as claim_keys built them, `token` the first
-- claim's, `before` its 0-based position in c.claims; items are counted from c.items.
local function timeline_claims(c, take, counts, sched, n, token, before)
  local items = {}
  for _, entry in ipairs(c.items) do
    if entry[1] >= before then
      local count, over = #entry - 1, ''
      for j = 2, #entry do if entry[j] == OVERFLOW then count, over = count - 1, '+' end end
      items[entry[1]] = count .. over
    end
  end
  local pos = before
  for i = 1, n, 2 do
    local head = take[i]
    if sched[i] then head = string.gsub(head, '|(%d+)$', '|S%1') end
    timeline_push(timeline_of(c.meta, take[i + 1]),
                  'c|' .. int(c.now) .. '|' .. int(token) .. '|' .. head .. '|'
                  .. counts[i] .. '|' .. (items[pos] or (c.items_at and '0' or '')) .. '|'
                  .. c.node)
    token, pos = token + 1, pos + 1
  end
end

-- Claim up to `limit` keys of one rule that are due by `c.now`, lowest due first,
-- each with a fencing token from `c.seq`, leased until `c.lease_until`, held by `c.node`. Appends
-- "RULE-INDEX|TOKEN|FIRST|LAST|ATTEMPT|DUE|COUNT|KEY" strings to `c.claims` (COUNT: the
-- burst's touches, see `pending` above). A key whose
-- score is early (a re-touch moved its due time, kept in meta) is re-scored. For a
-- rule with items (c.items_at, claim_items_at) each claim's items go to `c.items`.
-- `limit` is at most a few thousand (one unpack of the keys read).
-- claim_keys is its second half: claim the keys `ready`, already taken out of
-- `due_key` (the fair order of _fair.lua picks them its own way), in their order; it
-- returns those put back, due later (DUE, KEY, ...). With `c.ctokens` set, each claim's
-- token goes there at the claim's place in `c.claims`.
local function claim_keys(c, rule_index, due_key, inflight_key, ready)
  local states = read_fields(c.meta, ready)
  local take, counts, later, n, sched, lifts = {}, {}, {}, 0, {}, {}
  for i, key in ipairs(ready) do
    local first, due, last, tries, count = pending_times(states[i], c.now)
    if due > c.now then
      later[#later + 1], later[#later + 2] = due, key
      lifts[key] = state_prio(states[i])
    else  -- FIRST|LAST|ATTEMPT|DUE of the claim, and its key
      take[n + 1] = int(first) .. '|' .. int(last) .. '|' .. (tries + 1) .. '|' .. int(due)
      take[n + 2] = key
      counts[n + 1] = count
      sched[n + 1] = string.byte(states[i] or '', 1) == 83  -- "S": a touch's own time
      n = n + 2
    end
  end
  if #later > 0 then due_add(c.meta, due_key, later, lifts) end
  if n == 0 then return later end
  local token = take_tokens(c.seq, n / 2, c.now)
  local first_token = token + 1
  local states_out, leases, claims = {}, {}, c.claims
  local before = #claims
  local tail = '||||' .. c.node
  for i = 1, n, 2 do
    local key = take[i + 1]
    token = token + 1
    local head = int(token) .. '|' .. take[i]
    states_out[i], states_out[i + 1] = key, 'R|' .. head .. tail
    leases[i], leases[i + 1] = c.lease_until, key
    claims[#claims + 1] = rule_index .. '|' .. head .. '|' .. counts[i] .. '|' .. key
    if c.ctokens then c.ctokens[#claims] = token end
  end
  redis.call('HSET', c.meta, unpack(states_out))
  redis.call('ZADD', inflight_key, unpack(leases))
  if c.items_at then claim_items(c, rule_index, take, n, before) end
  timeline_claims(c, take, counts, sched, n, first_token, before)
  return later
end

local function claim_due(c, rule_index, due_key, inflight_key, limit)
  local ready = redis.call('ZRANGEBYSCORE', due_key, '-inf', c.now, 'LIMIT', 0, limit)
  if #ready == 0 then return end
  redis.call('ZREMRANGEBYRANK', due_key, 0, #ready - 1)
  claim_keys(c, rule_index, due_key, inflight_key, ready)
end

-- Append one finished refresh to the shard's history stream, capped near
-- `maxlen` entries (approximate trimming: cheap); `maxlen` 0 keeps no history.
-- `attempt` and `due` are the claim's as it ran ('' for a claim taken over); the
-- due time lets readers tell how late the refresh started.
local function record(history, maxlen, key, rule, node, token, attempt, due, start, ms, outcome,
                      err)
  if maxlen <= 0 then return end
  if err then
    redis.call('XADD', history, 'MAXLEN', '~', maxlen, '*', 'key', key, 'rule', rule,
               'node', node, 'token', token, 'attempt', attempt, 'start', start, 'ms', ms,
               'due', due, 'outcome', outcome, 'error', err)
  else
    redis.call('XADD', history, 'MAXLEN', '~', maxlen, '*', 'key', key, 'rule', rule,
               'node', node, 'token', token, 'attempt', attempt, 'start', start, 'ms', ms,
               'due', due, 'outcome', outcome)
  end
end

-- The due keys of the rules named in `paused_key` (a shard's copy of the paused rules,
-- see keys.py), as a set: due_key -> true. `meta_key` is the shard's meta key, whose
-- prefix the due keys share ("PREFIX:meta" and "PREFIX:due:RULE"). One SMEMBERS a call.
local function paused_due_keys(paused_key, meta_key)
  local prefix = string.sub(meta_key, 1, #meta_key - #'meta')
  local found = {}
  for _, rule in ipairs(redis.call('SMEMBERS', paused_key)) do
    found[prefix .. 'due:' .. rule] = true
  end
  return found
end

