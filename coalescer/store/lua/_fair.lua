-- _fair.lua: fair order between the groups of a rule (its `fair:`), prepended to
-- claim.lua after _lib.lua (script_calls.py). docs/concepts.md explains the order.
--
-- A rule with `fair: {by: "{org}"}` (or a priority) keeps its keys where every rule does
-- (meta, and due:RULE, the truth for every other script) and, mirrored by every script
-- that adds to due:RULE (due_add, _lib.lua), in an index by group that the claim takes
-- from in start-time fair order (SFQ, Goyal et al.):
--   PREFIX = NS:{NS:N}:fair:RULE: (the shard's; keys.py ShardKeys.fair)
--   PREFIX..q:GROUP  ZSET  key due within FAIR_AHEAD (_lib.lua), or due -> its due
--                          score; a key whose priority is above the rule's is moved up
--                          once due, to its due score less that difference (so a
--                          group's due keys go in priority order)
--   PREFIX..prio     ZSET  such a key -> its due score, until then
--   PREFIX..groups   ZSET  group with due keys -> the start tag of its next claim
--   PREFIX..heads    ZSET  group with keys, none due -> the score of its first
--   PREFIX..tags     ZSET  group out of `groups` -> the finish tag of its last claim,
--                          while that is ahead of the virtual time (a tag V has passed
--                          counts as none; the round drops those)
--   PREFIX..state    HASH  v      the virtual time: the start tag of the last claim
--                          ahead  how far due:RULE is indexed (fair_ahead)
--                          low    where the round over due:RULE goes on
--                          calls  the claim calls, counted FAIR_EVERY round
--                          spec   the spec this claim last published (fair_publish)
--   RUN..GROUP       HASH  key -> "TOKEN|META-KEY": the group's claims in flight (only
--                          with a cap), one set for all shards on one server
--   CONF             HASH  runtime settings: "w:VALUE" -> weight, "cap" -> max_running
--                          (0: no cap); they override the rules file's
-- A claim costs its group 1/weight of virtual time: S(next) = S + 1/w. A group whose
-- first key falls due (out of `heads`) starts at max(V, its last finish tag): a group
-- that was idle gets no credit for it, one that was just served waits its turn.
--
-- The claim publishes the rule's spec where the writers read it (the shard's FAIR-SPECS
-- hash, _lib.lua) and indexes, from due:RULE, the keys that came within FAIR_AHEAD of
-- their due time since its last call (written further ahead than that); when the spec
-- was absent or different, that look-ahead starts again from the first key, FAIR_SWEEP
-- keys a call: the keys written before the spec was there. The index is a hint,
-- checked at each claim: an entry whose key left due:RULE (claimed by a drain,
-- cancelled, moved) is dropped. A round over due:RULE, FAIR_LOW keys every FAIR_EVERY
-- calls, indexes any key missing from its queue (written by a client that predates the
-- index, say).

local FAIR_SWEEP, FAIR_LOW, FAIR_EVERY, FAIR_HEADS = 2000, 32, 32, 1000
-- The look-ahead reads due:RULE again once its horizon moved FAIR_STEP ms on: a key due
-- later than the writers index is still indexed at least FAIR_AHEAD - FAIR_STEP ms
-- before it falls due, and a busy claimer does not read the due set every call.
local FAIR_STEP = 1000

-- The fair section of ARGV, from `at` (its "\0FAIR" tag) on: N, then per fair rule
-- RULE-INDEX, LUA-PATTERN (its one capture is the group), PREFIX, RUN-PREFIX, CONF,
-- CAP (0: none), WEIGHTS ("VALUE\0W\0VALUE\0W..." or ""), PRIORITY-MS. Returns
-- rule index -> spec, or nil without a section.
local function fair_specs(from)
  local at = nil
  for i = from, #ARGV do
    if ARGV[i] == '\0FAIR' then at = i break end
  end
  if not at then return nil end
  local specs = {}
  for k = 0, tonumber(ARGV[at + 1]) - 1 do
    local a = at + 2 + 8 * k
    specs[tonumber(ARGV[a])] = {
      pattern = ARGV[a + 1], prefix = ARGV[a + 2], run = ARGV[a + 3], conf = ARGV[a + 4],
      cap = tonumber(ARGV[a + 5]), weights_arg = ARGV[a + 6], prio = tonumber(ARGV[a + 7])}
  end
  return specs
end

-- The weights (value -> weight) and cap of a fair rule: the file's, overridden by CONF.
local function fair_settings(f)
  local w = {}
  if f.weights_arg ~= '' then
    local parts = split_keys(f.weights_arg, select(2, string.gsub(f.weights_arg, '%z', '')) + 1)
    for i = 1, #parts - 1, 2 do w[parts[i]] = tonumber(parts[i + 1]) end
  end
  local over = redis.call('HGETALL', f.conf)
  for i = 1, #over, 2 do
    local field, v = over[i], tonumber(over[i + 1])
    if field == 'cap' then
      f.cap = v
    elseif string.sub(field, 1, 2) == 'w:' and v and v > 0 then
      w[string.sub(field, 3)] = v
    end
  end
  f.weights = w
end

local function weight_of(f, group)
  return f.weights[group] or 1
end

-- The priorities (ms) of the keys `keys` (key -> ms, from their pending states).
local function fair_prios(f, keys)
  local vals, out = read_fields(f.meta, keys), {}
  for i = 1, #keys do out[keys[i]] = state_prio(vals[i]) end
  return out
end

-- Mirror `got` (key, score, ... of due:RULE, as ZRANGE WITHSCORES gives) into the index.
local function fair_index(f, due_key, got)
  if #got == 0 then return end
  local keys, entries = {}, {}
  for i = 1, #got, 2 do
    keys[#keys + 1] = got[i]
    entries[i], entries[i + 1] = got[i + 1], got[i]
  end
  fair_mirror(f.meta, due_key, entries, fair_prios(f, keys))
end

-- The rank in `due_key` of the first entry after (`score`, `member`) in its order (by
-- score, then member, bytewise): a binary search within the entries of that score, so
-- a look-ahead cut inside thousands of keys due in the same millisecond goes on from
-- there. Also returns how many entries sort before `score`.
local function rank_after(due_key, score, member)
  local below = redis.call('ZCOUNT', due_key, '-inf', '(' .. score)
  local lo, hi = below, below + redis.call('ZCOUNT', due_key, score, score)
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if redis.call('ZRANGE', due_key, mid, mid)[1] <= member then lo = mid + 1 else hi = mid end
  end
  return lo, below
end

-- A mark "SCORE|MEMBER" (a place in due:RULE's order) as its score and member.
local function parse_mark(mark)
  local bar = string.find(mark, '|', 1, true)
  if not bar then return tonumber(mark), '' end
  return tonumber(string.sub(mark, 1, bar - 1)), string.sub(mark, bar + 1)
end


-- Publish the rule's spec for the writers; when it was absent or different, the
-- look-ahead starts again from the first key (see fair_ahead). The state keeps the spec
-- last published: the writers' copy is read again only when that differs, and at each
-- round (an evicted copy comes back within FAIR_EVERY calls).
local function fair_publish(f, due_key)
  local spec = f.pattern .. '\0' .. f.prefix .. '\0' .. int(f.prio)
  local specs = fair_specs_key(f.meta)
  if (f.state.spec ~= spec or f.state.calls == 0)
      and redis.call('HGET', specs, due_key) ~= spec then
    redis.call('HSET', specs, due_key, spec)
    f.state.ahead = ''  -- from the first key on
  end
  f.state.spec = spec
  fair_specs_read[due_key] = {pattern = f.pattern, prefix = f.prefix, prio = f.prio}
end

-- A rule claimed in plain order whose spec is still published (its node's rules lost
-- their `fair:`): the writers stop mirroring, and its index is deleted.
local function fair_unpublish(meta, due_key)
  local f = fair_spec_of(meta, due_key)
  if not f then return end
  redis.call('HDEL', fair_specs_key(meta), due_key)
  fair_specs_read[due_key] = false
  for _, set in ipairs({'groups', 'heads'}) do
    for _, g in ipairs(redis.call('ZRANGE', f.prefix .. set, 0, -1)) do
      redis.call('DEL', f.prefix .. 'q:' .. g)
    end
  end
  redis.call('DEL', f.prefix .. 'groups', f.prefix .. 'heads', f.prefix .. 'prio',
             f.prefix .. 'tags', f.prefix .. 'state')
end

-- The look-ahead: the keys of due:RULE that came within FAIR_AHEAD (_lib.lua) of their
-- due time since it last read, FAIR_SWEEP a call, indexed (the writers index those they
-- write due sooner); it reads once its horizon moved FAIR_STEP on. State ahead:
-- "SCORE|MEMBER", the last key indexed when a call was cut, else "SCORE|", every key up
-- to that score; "" (a spec just published): from the first key, which builds the index
-- of the keys written before.
local function fair_ahead(c, f, due_key)
  local horizon = c.now + FAIR_AHEAD
  local score, member = parse_mark(f.state.ahead or '')
  if score and member == '' and score <= horizon and horizon - score < FAIR_STEP then
    return  -- indexed up to less than a step ago
  end
  if score and score > horizon then score, member = horizon, '' end  -- the clock stepped back
  local start, below = 0, 0  -- (a mark without a member starts at its score)
  if score and member ~= '' then start, below = rank_after(due_key, int(score), member) end
  local got = redis.call('ZRANGE', due_key, score and int(score) or '-inf', int(horizon),
                         'BYSCORE', 'LIMIT', start - below, FAIR_SWEEP, 'WITHSCORES')
  fair_index(f, due_key, got)
  if #got == 2 * FAIR_SWEEP then
    f.state.ahead = got[#got] .. '|' .. got[#got - 1]
  else
    f.state.ahead = int(horizon) .. '|'
  end
end

-- The round: FAIR_LOW keys of due:RULE every FAIR_EVERY calls, in due order up to the
-- look-ahead's horizon and round again, indexing those missing from their queue; and
-- the finish tags the virtual time has passed dropped.
local function fair_round(c, f, due_key)
  if f.state.calls ~= 0 then return end
  redis.call('ZREMRANGEBYSCORE', f.prefix .. 'tags', '-inf', f.v)
  local at = tonumber(f.state.low) or 0
  local got = redis.call('ZRANGE', due_key, at, at + FAIR_LOW - 1, 'WITHSCORES')
  f.state.low = #got == 2 * FAIR_LOW and at + FAIR_LOW or 0
  while #got > 0 and tonumber(got[#got]) > c.now + FAIR_AHEAD do
    got[#got], got[#got - 1] = nil, nil
    f.state.low = 0
  end
  local by, order = {}, {}
  for i = 1, #got, 2 do
    local g = string.match(got[i], f.pattern) or ''
    if not by[g] then
      by[g] = {}
      order[#order + 1] = g
    end
    by[g][#by[g] + 1] = i
  end
  local missing = {}
  for _, g in ipairs(order) do
    local keys = {}
    for j, i in ipairs(by[g]) do keys[j] = got[i] end
    local scores = redis.call('ZMSCORE', f.prefix .. 'q:' .. g, unpack(keys))
    for j, i in ipairs(by[g]) do
      if not scores[j] then missing[#missing + 1], missing[#missing + 2] = got[i], got[i + 1] end
    end
  end
  fair_index(f, due_key, missing)
end

-- Keys of `prio` that fell due move up their queue (to their due score less the part of
-- their priority above the rule's); those no longer pending are dropped, those due later
-- (a re-touch) wait on at that time.
local function fair_lift(c, f, due_key)
  local got = redis.call('ZRANGE', f.prefix .. 'prio', '-inf', int(c.now), 'BYSCORE', 'LIMIT',
                         0, FAIR_SWEEP)
  if #got == 0 then return end
  redis.call('ZREM', f.prefix .. 'prio', unpack(got))
  local dues, prios, later = redis.call('ZMSCORE', due_key, unpack(got)), fair_prios(f, got), {}
  for i, key in ipairs(got) do
    local due = tonumber(dues[i])
    if due and due > c.now then
      later[#later + 1], later[#later + 2] = due, key
    elseif due then
      local g = string.match(key, f.pattern) or ''
      redis.call('ZADD', f.prefix .. 'q:' .. g, 'XX', due - math.max(0, prios[key] - f.prio), key)
    end
  end
  if #later > 0 then redis.call('ZADD', f.prefix .. 'prio', unpack(later)) end
end

-- Groups whose first key fell due join the order at max(V, their last finish tag).
local function fair_wake(c, f)
  local heads, groups, tags = f.prefix .. 'heads', f.prefix .. 'groups', f.prefix .. 'tags'
  local due = redis.call('ZRANGE', heads, '-inf', int(c.now), 'BYSCORE', 'LIMIT', 0, FAIR_HEADS)
  if #due == 0 then return end
  redis.call('ZREM', heads, unpack(due))
  local finish = redis.call('ZMSCORE', tags, unpack(due))
  local entries = {}
  for i, g in ipairs(due) do
    local start = math.max(f.v, tonumber(finish[i]) or f.v)
    entries[#entries + 1], entries[#entries + 2] = start, g
  end
  redis.call('ZADD', groups, 'NX', unpack(entries))
end

-- Group `g` leaves the order (no due key left): back to `heads` at its first key's
-- score while it has keys, its finish tag `finish` kept while ahead of V.
local function fair_rest(f, g, finish)
  redis.call('ZREM', f.prefix .. 'groups', g)
  local first = redis.call('ZRANGE', f.prefix .. 'q:' .. g, 0, 0, 'WITHSCORES')
  if first[2] then redis.call('ZADD', f.prefix .. 'heads', first[2], g) end
  if finish > f.v then redis.call('ZADD', f.prefix .. 'tags', finish, g) end
end

-- How many more claims of `group` its cap allows (a large number without a cap). The
-- group's run set is read only when it could bind; an entry whose key no longer runs
-- that claim (acked, failed, recovered, given back) is dropped there.
local function fair_room(f, group, want)
  if not f.cap or f.cap <= 0 then return want end
  local run = f.run .. group
  local n = redis.call('HLEN', run)
  if n + want <= f.cap then return want end
  local all, gone = redis.call('HGETALL', run), {}
  for i = 1, #all, 2 do
    local token, meta = string.match(all[i + 1], '^(%d+)|(.*)$')
    local r = decode(redis.call('HGET', meta, all[i]))
    if not (r and r.kind == 'R' and r.token == tonumber(token)) then
      gone[#gone + 1] = all[i]
    end
  end
  if #gone > 0 then redis.call('HDEL', run, unpack(gone)) end
  return math.max(0, math.min(want, f.cap - (n - #gone)))
end

-- A binary heap of groups by start tag (ties: the group's name).
local function fair_before(a, b)
  if a.s ~= b.s then return a.s < b.s end
  return a.g < b.g
end

local function heap_push(h, x)
  h[#h + 1] = x
  local i = #h
  while i > 1 do
    local p = math.floor(i / 2)
    if fair_before(h[p], h[i]) then break end
    h[p], h[i] = h[i], h[p]
    i = p
  end
end

-- Move the group at `i` down to its place (its start tag grew, or it came from the end).
local function heap_down(h, i)
  local n = #h
  while true do
    local l, r, m = 2 * i, 2 * i + 1, i
    if l <= n and fair_before(h[l], h[m]) then m = l end
    if r <= n and fair_before(h[r], h[m]) then m = r end
    if m == i then return end
    h[m], h[i] = h[i], h[m]
    i = m
  end
end

-- Take the first group out of the heap.
local function heap_drop(h)
  h[1] = h[#h]
  h[#h] = nil
  if #h > 1 then heap_down(h, 1) end
end

-- Plan up to `limit` claims in SFQ order. Candidates are read in start-tag order until
-- `limit` of them may take a claim (no group after those can be reached in `limit`
-- picks), at most FAIR_PAGES pages of `limit` groups: a group its cap holds back never
-- hides the others. Returns the candidates ({g, s, w, take}), whether a cap held back a
-- group with due keys, and the picks (a candidate per claim, in the order picked; nil
-- when one group alone takes them all).
local FAIR_PAGES = 8

-- The plan when one group alone may take claims (one tenant's import, say): the picks
-- the heap would make, `x` every time, without the heap. Returns nil for the picks
-- (fair_pop then takes `x`'s keys in their queue's order).
local function fair_plan_lone(f, x, limit)
  local take = math.min(x.left, limit)
  for _ = 1, take do  -- the same sums as the heap's picks
    if x.s > f.v then f.v = x.s end
    x.s = x.s + 1 / x.w
  end
  x.take, x.left = take, x.left - take
  return nil
end

local function fair_plan(f, limit)
  local heap, cands, capped, open, picks = {}, {}, false, 0, {}
  local groups = f.prefix .. 'groups'
  for page = 0, FAIR_PAGES - 1 do
    local found = redis.call('ZRANGE', groups, page * limit, (page + 1) * limit - 1,
                             'WITHSCORES')
    for i = 1, #found, 2 do
      local g = found[i]
      local n = redis.call('ZCOUNT', f.prefix .. 'q:' .. g, '-inf', int(f.now))
      local have = math.min(n, limit)
      local room = fair_room(f, g, have)
      local s0 = tonumber(found[i + 1])
      if have == 0 then fair_rest(f, g, s0) end
      if room < have then capped = true end
      local x = {g = g, s = s0, s0 = s0, n = n, w = weight_of(f, g), left = room, take = 0}
      cands[#cands + 1] = x
      if room > 0 then
        heap_push(heap, x)
        open = open + 1
      end
    end
    if open >= limit or #found < 2 * limit then break end
  end
  if open == 1 then return cands, capped, fair_plan_lone(f, heap[1], limit) end
  for _ = 1, limit do
    local x = heap[1]  -- the lowest start tag takes the claim, and its tag moves on
    if not x then break end
    if x.s > f.v then f.v = x.s end
    x.take, x.left, x.s = x.take + 1, x.left - 1, x.s + 1 / x.w
    picks[#picks + 1] = x
    if x.left > 0 then heap_down(heap, 1) else heap_drop(heap) end
  end
  return cands, capped, picks
end

-- The keys a lone taker `x` (the one group of the call's plan that takes keys) claims
-- when its queue's first `take` keys are, in order, the first due keys of due:RULE (one
-- tenant's import, say): both cut by rank, with no lookup per key. Else nil, nothing
-- changed (fair_pop then takes them key by key).
local function fair_run(c, f, due_key, x)
  local q = f.prefix .. 'q:' .. x.g
  local mine = redis.call('ZRANGE', q, 0, x.take - 1)
  local due = redis.call('ZRANGE', due_key, '-inf', int(c.now), 'BYSCORE', 'LIMIT', 0, #mine)
  if #mine == 0 or #due ~= #mine then return nil end  -- (a range 0..-1 would be all)
  for i = 1, #mine do
    if mine[i] ~= due[i] then return nil end
  end
  redis.call('ZREMRANGEBYRANK', q, 0, #mine - 1)
  redis.call('ZREMRANGEBYRANK', due_key, 0, #mine - 1)
  x.popped = #mine
  return mine
end

-- Each taking candidate's lowest `take` keys (all due: it has at least that many)
-- popped from its queue (x.popped of them), and those still due in due:RULE taken out
-- of it; one due later there goes back to its queue at that time. Returns the keys in
-- the order of the plan's picks, which is the order their refreshes start in: a
-- quiet tenant's key goes with the first of a batch, not after a busy tenant's; and
-- beside them, the candidate each came from.
local function fair_pop(c, f, due_key, cands, picks)
  for _, x in ipairs(cands) do
    if x.take > 0 then
      local popped = redis.call('ZPOPMIN', f.prefix .. 'q:' .. x.g, x.take)
      x.popped, x.keys, x.next = #popped / 2, {}, 1
      for i = 1, #popped, 2 do x.keys[#x.keys + 1] = popped[i] end
    end
  end
  local keys, from = {}, {}
  local function next_of(x)
    local key = x.keys[x.next]
    if not key then return end
    local n = #keys + 1
    keys[n], from[n], x.next = key, x, x.next + 1
  end
  if picks then
    for _, x in ipairs(picks) do next_of(x) end
  else  -- one group takes them all, in its queue's order
    for _, x in ipairs(cands) do
      for _ = 1, x.keys and #x.keys or 0 do next_of(x) end
    end
  end
  if #keys == 0 then return keys, from end
  local scores, ready, owner = redis.call('ZMSCORE', due_key, unpack(keys)), {}, {}
  for i = 1, #keys do
    local due = tonumber(scores[i])
    if due and due > c.now then
      redis.call('ZADD', f.prefix .. 'q:' .. from[i].g, due, keys[i])
    elseif due then
      local n = #ready + 1
      ready[n], owner[n] = keys[i], from[i]
    end
  end
  if #ready > 0 then redis.call('ZREM', due_key, unpack(ready)) end
  return ready, owner
end

-- The one candidate that takes keys, or nil when none or several do.
local function lone_taker(cands)
  local one = nil
  for _, x in ipairs(cands) do
    if x.take > 0 then
      if one then return nil end
      one = x
    end
  end
  return one
end

-- Per group, the claims claim_keys made of `ready` (those of `owner[i]`, else all of
-- `lone`), from `before_n` on in c.claims, less those it put back (`later`). With a
-- cap each claim also goes into its group's run set (its token from c.ctokens).
local function fair_count(c, f, cands, before_n, ready, owner, lone, later)
  if #later == 0 and not c.ctokens and not owner then
    return {[lone.g] = #c.claims - before_n}
  end
  local back, got, runs, at = {}, {}, {}, before_n
  for i = 2, #later, 2 do back[later[i]] = true end
  for i, key in ipairs(ready) do
    if not back[key] then
      at = at + 1
      local g = owner and owner[i].g or lone.g
      got[g] = (got[g] or 0) + 1
      if c.ctokens then
        runs[g] = runs[g] or {}
        local t = runs[g]
        t[#t + 1], t[#t + 2] = key, int(c.ctokens[at]) .. '|' .. c.meta
      end
    end
  end
  for _, x in ipairs(cands) do
    if runs[x.g] then redis.call('HSET', f.run .. x.g, unpack(runs[x.g])) end
  end
  return got
end

-- Claim the planned keys of every candidate in one go (fair_run, else fair_pop), by one
-- claim_keys call (a few commands for the batch, not per group). Returns group -> the
-- claims it got.
local function fair_take(c, f, r, due_key, inflight_key, cands, picks)
  local x = lone_taker(cands)
  local ready, owner = x and fair_run(c, f, due_key, x), nil
  if not ready then ready, owner = fair_pop(c, f, due_key, cands, picks) end
  if #ready == 0 then return {} end
  local before_n = #c.claims
  if f.cap and f.cap > 0 then c.ctokens = {} end
  local later = claim_keys(c, r, due_key, inflight_key, ready)
  local got = fair_count(c, f, cands, before_n, ready, owner, x, later)
  c.ctokens = nil
  return got
end

-- Claim up to `limit` due keys of fair rule `r` (spec `f`) in fair order; returns
-- whether a cap held back a group that has due keys.
local function claim_fair(c, r, due_key, inflight_key, limit, f)
  local st = redis.call('HMGET', f.prefix .. 'state', 'v', 'ahead', 'low', 'calls', 'spec')
  f.state = {ahead = st[2] or nil, low = st[3] or nil, spec = st[5] or nil,
             calls = ((tonumber(st[4]) or 0) + 1) % FAIR_EVERY}  -- 0: this call is a round
  f.v, f.meta, f.now = tonumber(st[1]) or 0, c.meta, c.now
  fair_settings(f)
  fair_publish(f, due_key)
  fair_ahead(c, f, due_key)
  fair_round(c, f, due_key)
  fair_lift(c, f, due_key)
  fair_wake(c, f)
  local cands, capped, picks = fair_plan(f, limit)
  local got, stay = fair_take(c, f, r, due_key, inflight_key, cands, picks), {}
  for _, x in ipairs(cands) do
    if x.take > 0 then
      local start = x.s0 + (got[x.g] or 0) / x.w
      if x.n > x.popped then
        stay[#stay + 1], stay[#stay + 2] = start, x.g
      else
        fair_rest(f, x.g, start)
      end
    end
  end
  if #stay > 0 then redis.call('ZADD', f.prefix .. 'groups', unpack(stay)) end
  redis.call('HSET', f.prefix .. 'state', 'v', tostring(f.v), 'ahead', f.state.ahead,
             'low', tostring(f.state.low or 0), 'calls', tostring(f.state.calls),
             'spec', f.state.spec)
  return capped
end
