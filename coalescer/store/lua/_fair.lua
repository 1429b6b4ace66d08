-- _fair.lua: fair order between the groups of a rule (its `fair:`), prepended to
-- claim.lua after _lib.lua (script_calls.py). docs/concepts.md explains the order.
--
-- A rule with `fair: {by: "{org}"}` keeps its keys where every rule does (meta, and
-- due:RULE, the truth for every other script). The claim script indexes its due keys
-- by group, and claims from that index in start-time fair order (SFQ, Goyal et al.):
--   PREFIX = NS:{NS:N}:fair:RULE: (the shard's; keys.py ShardKeys.fair)
--   PREFIX..q:GROUP  ZSET  due key -> its due score less its priority (the larger of
--                          the rule's and the one its touches gave, kept in its
--                          pending state: _lib.lua): the due keys of one group,
--                          indexed (a copy: due:RULE keeps them)
--   PREFIX..groups   ZSET  group with indexed keys -> the start tag of its next claim
--   PREFIX..tags     ZSET  group without indexed keys -> the finish tag of its last
--                          claim, while that is ahead of the virtual time
--   PREFIX..state    HASH  read once and written once a call (f.state):
--                          v      the virtual time: the start tag of the last claim
--                          swept  how far due:RULE is indexed: "SCORE|MEMBER" (fair_sweep)
--                          head   the score up to which the fast lane looked (fair_fast)
--                          gaps   the gaps, newest first: "FROM\0TO\0FROM\0TO...", each
--                                 the keys due from one mark "SCORE|MEMBER" to another
--                                 that the fast lane has yet to look at (fair_gaps)
--                          low    where the round over the keys below that point goes on
--   RUN..GROUP       HASH  key -> "TOKEN|META-KEY": the group's claims in flight (only
--                          with a cap), one set for all shards on one server
--   CONF             HASH  runtime settings: "w:VALUE" -> weight, "cap" -> max_running
--                          (0: no cap); they override the rules file's
-- A claim costs its group 1/weight of virtual time: S(next) = S + 1/w. A group that
-- gets keys again starts at max(V, its last finish tag): a group that was idle gets
-- no credit for it, one that was just served waits its turn.
--
-- The index is a hint, checked at each claim: an entry whose key left due:RULE
-- (claimed by a drain, cancelled, moved) is dropped, and a key whose due time moved
-- later (a re-touch) goes back to due:RULE at that time (claim_keys). Each call
-- indexes the keys due since the last sweep (at most FAIR_SWEEP of them), and reads
-- FAIR_LOW of the keys below that point, going round them call after call (state low:
-- the rank it goes on from), indexing those missing from their queue: a key put back
-- with a due time already past (a touch that came while it ran, a claim given back) is
-- found there within a round, however many keys are due before it.
--
-- When a call's sweep is cut (a backlog poured in faster than it indexes), a fast lane
-- looks at the keys that fell due since the last call, newest first (at most FAIR_FAST
-- of them, read and matched only), and indexes at once those of groups with fewer
-- than FAIR_SHORT keys in their queue: a quiet group's new key is claimable at the
-- next call, however far behind the backlog of another group keeps the sweep. The
-- sweep indexes them again when it gets there (the same entry: no harm). When more
-- than FAIR_FAST keys fell due since the last call, the older ones it did not read
-- make a gap, which the lane walks newest first with what is left of its FAIR_FAST,
-- and at least FAIR_GAP keys a call (while each call's newest keys fill FAIR_FAST): a
-- quiet group's key that fell due just before a large write is found a call or two
-- later, not when the sweep gets there. Each capped read makes a gap of its own (the
-- keys between two gaps were read): every key is looked at once, by the lane or in a
-- gap, however many writes larger than FAIR_FAST fall due while the sweep is behind.
-- Past FAIR_GAPS gaps, the two oldest merge (the keys between them are read again).

local FAIR_SWEEP, FAIR_LOW, FAIR_FAST, FAIR_SHORT, FAIR_GAP = 2000, 16, 10000, 64, 2000
local FAIR_GAPS = 32

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

-- The priorities (ms) of the keys `got` (key, score, ... of due:RULE): each the larger
-- of the rule's and its pending state's ("!" and base 36 at the end, _lib.lua).
local function fair_prios(f, got)
  local keys = {}
  for i = 1, #got, 2 do keys[#keys + 1] = got[i] end
  local vals, out = read_fields(f.meta, keys), {}
  for i = 1, #keys do
    local v, p = vals[i], nil
    if v and string.byte(v, 1) ~= 82 and string.byte(v, 1) ~= 68  -- not R, D
        and string.find(v, '!', 1, true) then  -- (a plain find first: most have none)
      p = string.match(v, '!([%da-z]+)$')
    end
    out[i] = math.max(f.prio, p and tonumber(p, 36) or 0)
  end
  return out
end

-- The entries of `got` (key, score, key, score, ... of due:RULE) by group: group ->
-- the indices of their keys in `got`, and the groups in the order first met.
local function by_group(f, got)
  local by, order = {}, {}
  for i = 1, #got, 2 do
    local group = string.match(got[i], f.pattern) or ''
    local t = by[group]
    if not t then
      t = {}
      by[group] = t
      order[#order + 1] = group
    end
    t[#t + 1] = i
  end
  return by, order
end

-- Index `got` (key, score, key, score, ... of due:RULE) by group.
local function fair_index(f, got)
  if #got == 0 then return end
  local prios = fair_prios(f, got)
  local by, order = by_group(f, got)
  for _, group in ipairs(order) do
    local entries = {}
    for _, i in ipairs(by[group]) do
      entries[#entries + 1] = tonumber(got[i + 1]) - prios[(i + 1) / 2]
      entries[#entries + 1] = got[i]
    end
    each_chunk('ZADD', f.prefix .. 'q:' .. group, entries)
    if not redis.call('ZSCORE', f.prefix .. 'groups', group) then
      local start = f.v
      local finish = tonumber(redis.call('ZSCORE', f.prefix .. 'tags', group))
      if finish and finish > start then start = finish end
      redis.call('ZADD', f.prefix .. 'groups', start, group)
    end
  end
end

-- Of `got` (key, score, ... of due:RULE), those not in their group's queue: the round
-- below the sweep looks for keys put back, and most of what it reads is indexed already
-- (one ZMSCORE a group instead of indexing them all again).
local function fair_missing(f, got)
  local by, order = by_group(f, got)
  local out = {}
  for _, group in ipairs(order) do
    local at, keys = by[group], {}
    for j = 1, #at do keys[j] = got[at[j]] end
    local scores = redis.call('ZMSCORE', f.prefix .. 'q:' .. group, unpack(keys))
    for j = 1, #at do
      if not scores[j] then out[#out + 1], out[#out + 2] = got[at[j]], got[at[j] + 1] end
    end
  end
  return out
end

-- The rank in `due_key` of the first entry after (`score`, `member`) in its order (by
-- score, then member, bytewise): a binary search within the entries of that score, so
-- a sweep cut inside thousands of keys due in the same millisecond goes on from there.
-- Also returns how many entries sort before `score`.
local function rank_after(due_key, score, member)
  local below = redis.call('ZCOUNT', due_key, '-inf', '(' .. score)
  if member == '' then return below, below end
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

-- Whether mark `a` is later in due:RULE's order than mark `b` (see parse_mark).
local function later(a, b)
  local sa, ma = parse_mark(a)
  local sb, mb = parse_mark(b)
  if sa ~= sb then return sa > sb end
  return ma > mb
end

-- Of `got` (key, score, ... of due:RULE), appended to `picked`: the keys of groups with
-- fewer than FAIR_SHORT keys queued (`queued`: group -> its count, kept across reads).
local function pick_short(f, got, queued, picked)
  for i = 1, #got, 2 do
    local group = string.match(got[i], f.pattern) or ''
    local n = queued[group] or redis.call('ZCARD', f.prefix .. 'q:' .. group)
    if n < FAIR_SHORT then
      picked[#picked + 1], picked[#picked + 2] = got[i], got[i + 1]
      n = n + 1
    end
    queued[group] = n
  end
end

-- The gaps of state field `gaps` ({from, to} marks, newest first), and back.
local function read_gaps(joined)
  local gaps = {}
  if not joined or joined == '' then return gaps end
  local parts = split_keys(joined, select(2, string.gsub(joined, '%z', '')) + 1)
  for i = 1, #parts - 1, 2 do gaps[#gaps + 1] = {from = parts[i], to = parts[i + 1]} end
  return gaps
end

local function join_gaps(gaps)
  local parts = {}
  for _, g in ipairs(gaps) do parts[#parts + 1], parts[#parts + 2] = g.from, g.to end
  return table.concat(parts, '\0')
end

-- One gap's walk (see the header): up to `budget` keys of gap `g`, newest first (a
-- quiet group's key most likely waits just below the write that hid it), down to its
-- start or the sweep's mark, whichever is later; moves the gap's end below them.
-- Returns how many keys it read, and whether the gap is read down to its start.
local function fair_gap(f, due_key, g, budget, queued, picked)
  local from = g.from
  if later(f.state.swept, from) then from = f.state.swept end
  local low = parse_mark(from)
  local score, member = parse_mark(g.to)
  if low > score then return 0, true end
  local skip = 0  -- the keys of the end's score after its member: looked at already
  if member ~= '' then
    local rank, below = rank_after(due_key, int(score), member)
    skip = redis.call('ZCOUNT', due_key, int(score), int(score)) - (rank - below)
  end
  local got = redis.call('ZRANGE', due_key, int(score), int(low), 'BYSCORE', 'REV',
                         'LIMIT', skip, budget, 'WITHSCORES')
  pick_short(f, got, queued, picked)
  if #got < 2 * budget then return #got / 2, true end
  g.to = got[#got] .. '|' .. got[#got - 1]
  return budget, false
end

-- The gaps' walk: `budget` keys at most, the newest gap first; drops the gaps read
-- down to their start.
local function fair_gaps(f, due_key, gaps, budget, queued, picked)
  local left = {}
  for _, g in ipairs(gaps) do
    if budget > 0 then
      local read, done = fair_gap(f, due_key, g, budget, queued, picked)
      budget = budget - read
      if not done then left[#left + 1] = g end
    else
      left[#left + 1] = g
    end
  end
  return left
end

-- The fast lane (see the header): from the keys due in (state head, now], newest
-- first, index those of groups with a short queue; keys its read left out (more fell
-- due since the last call than it reads) make a new gap; the gaps are walked newest
-- first with what is left of FAIR_FAST, at least FAIR_GAP keys. Only when this call's
-- sweep was cut (else it indexed them all, and the gaps with them); the first call
-- looks at every due key.
local function fair_fast(c, f, due_key, cut)
  local head = tonumber(f.state.head)
  f.state.head = int(c.now)
  if not cut then
    f.state.gaps = nil
    return
  end
  if head and head > c.now then head = nil end  -- the clock stepped back
  local got = redis.call('ZRANGE', due_key, int(c.now), head and '(' .. int(head) or '-inf',
                         'BYSCORE', 'REV', 'LIMIT', 0, FAIR_FAST, 'WITHSCORES')
  local queued, picked, gaps = {}, {}, read_gaps(f.state.gaps)
  pick_short(f, got, queued, picked)
  if #got == 2 * FAIR_FAST then  -- keys from head to the oldest read were not looked at
    table.insert(gaps, 1, {from = head and int(head) .. '|' or f.state.swept,
                           to = got[#got] .. '|' .. got[#got - 1]})
    if #gaps > FAIR_GAPS then
      gaps[#gaps - 1].from = gaps[#gaps].from
      gaps[#gaps] = nil
    end
  end
  if #gaps > 0 then
    gaps = fair_gaps(f, due_key, gaps, math.max(FAIR_FAST - #got / 2, FAIR_GAP), queued,
                     picked)
  end
  f.state.gaps = #gaps > 0 and join_gaps(gaps) or nil
  fair_index(f, picked)
end

-- Index the keys of due:RULE due since the last sweep (see the header). State swept
-- holds "SCORE|MEMBER": the last entry indexed when a sweep was cut, else "NOW|".
local function fair_sweep(c, f, due_key)
  local mark = f.state.swept
  local score, member = nil, ''
  if mark then score, member = parse_mark(mark) end
  if score and score > c.now then score = nil end  -- the clock stepped back: all again
  local start, below = 0, 0
  if score then start, below = rank_after(due_key, int(score), member) end
  -- only keys due by now are read: the many due later cost nothing
  local got = redis.call('ZRANGE', due_key, score and int(score) or '-inf', int(c.now),
                         'BYSCORE', 'LIMIT', start - below, FAIR_SWEEP, 'WITHSCORES')
  local n = #got
  fair_index(f, got)
  if start > 0 then  -- the keys below the sweep point, FAIR_LOW a call, round and round
    local at = tonumber(f.state.low) or 0
    if at >= start then at = 0 end
    local stop = math.min(at + FAIR_LOW, start) - 1
    fair_index(f, fair_missing(f, redis.call('ZRANGE', due_key, at, stop, 'WITHSCORES')))
    f.state.low = stop + 1 >= start and 0 or stop + 1
  end
  if n == 2 * FAIR_SWEEP then
    mark = got[n] .. '|' .. got[n - 1]
  else
    mark = int(c.now) .. '|'
  end
  f.state.swept = mark
  fair_fast(c, f, due_key, n == 2 * FAIR_SWEEP)
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

local function heap_pop(h)
  local top, last = h[1], h[#h]
  h[#h] = nil
  if #h > 0 then
    h[1] = last
    local i = 1
    while true do
      local l, r, m = 2 * i, 2 * i + 1, i
      if l <= #h and fair_before(h[l], h[m]) then m = l end
      if r <= #h and fair_before(h[r], h[m]) then m = r end
      if m == i then break end
      h[m], h[i] = h[i], h[m]
      i = m
    end
  end
  return top
end

-- Plan up to `limit` claims in SFQ order. Candidates are read in start-tag order until
-- `limit` of them may take a claim (no group after those can be reached in `limit`
-- picks), at most FAIR_PAGES pages of `limit` groups: a group its cap holds back never
-- hides the others. Returns the candidates ({g, s, w, take}) and whether a cap held
-- back a group with due keys.
local FAIR_PAGES = 8

local function fair_plan(f, limit)
  local heap, cands, capped, open = {}, {}, false, 0
  local groups = f.prefix .. 'groups'
  for page = 0, FAIR_PAGES - 1 do
    local found = redis.call('ZRANGE', groups, page * limit, (page + 1) * limit - 1,
                             'WITHSCORES')
    for i = 1, #found, 2 do
      local g = found[i]
      local n = redis.call('ZCARD', f.prefix .. 'q:' .. g)
      local have = math.min(n, limit)
      local room = fair_room(f, g, have)
      if have == 0 then redis.call('ZREM', groups, g) end
      if room < have then capped = true end
      local s0 = tonumber(found[i + 1])
      local x = {g = g, s = s0, s0 = s0, n = n, w = weight_of(f, g), left = room, take = 0}
      cands[#cands + 1] = x
      if room > 0 then
        heap_push(heap, x)
        open = open + 1
      end
    end
    if open >= limit or #found < 2 * limit then break end
  end
  for _ = 1, limit do
    local x = heap_pop(heap)
    if not x then break end
    if x.s > f.v then f.v = x.s end
    x.take, x.left, x.s = x.take + 1, x.left - 1, x.s + 1 / x.w
    if x.left > 0 then heap_push(heap, x) end
  end
  return cands, capped
end

-- Claim the planned keys of every candidate in one go: each group's lowest `take` keys
-- popped from its queue (x.popped of them), those still in due:RULE claimed by one
-- claim_keys call (a few commands for the batch, not per group). Returns group -> the
-- claims it got.
local function fair_take(c, f, r, due_key, inflight_key, cands)
  local keys, group_of, got = {}, {}, {}
  for _, x in ipairs(cands) do
    if x.take > 0 then
      local popped = redis.call('ZPOPMIN', f.prefix .. 'q:' .. x.g, x.take)
      x.popped = #popped / 2
      for i = 1, #popped, 2 do
        keys[#keys + 1] = popped[i]
        group_of[popped[i]] = x.g
      end
    end
  end
  if #keys == 0 then return got end
  local scores, ready = redis.call('ZMSCORE', due_key, unpack(keys)), {}
  for i = 1, #keys do
    if scores[i] then ready[#ready + 1] = keys[i] end
  end
  if #ready == 0 then return got end
  redis.call('ZREM', due_key, unpack(ready))
  local before_n = #c.claims
  c.ckeys, c.ctokens = {}, {}  -- claim_keys notes each claim's key and token there
  claim_keys(c, r, due_key, inflight_key, ready)
  local runs = {}
  for i = before_n + 1, #c.claims do
    local key = c.ckeys[i]
    local g = group_of[key]
    got[g] = (got[g] or 0) + 1
    if f.cap and f.cap > 0 then
      local t = runs[g]
      if not t then
        t = {}
        runs[g] = t
      end
      t[#t + 1], t[#t + 2] = key, int(c.ctokens[i]) .. '|' .. c.meta
    end
  end
  c.ckeys, c.ctokens = nil, nil
  for _, x in ipairs(cands) do
    if runs[x.g] then redis.call('HSET', f.run .. x.g, unpack(runs[x.g])) end
  end
  return got
end

-- Claim up to `limit` due keys of fair rule `r` (spec `f`) in fair order; returns
-- whether a cap held back a group that has due keys.
local function claim_fair(c, r, due_key, inflight_key, limit, f)
  local st = redis.call('HMGET', f.prefix .. 'state', 'v', 'swept', 'head', 'low', 'gaps')
  f.state = {swept = st[2] or nil, head = st[3] or nil, low = st[4] or nil,
             gaps = st[5] or nil}
  local had_gap = f.state.gaps ~= nil
  f.v, f.meta = tonumber(st[1]) or 0, c.meta
  fair_settings(f)
  fair_sweep(c, f, due_key)
  redis.call('ZREMRANGEBYSCORE', f.prefix .. 'tags', '-inf', f.v)
  local cands, capped = fair_plan(f, limit)
  local got = fair_take(c, f, r, due_key, inflight_key, cands)
  local groups, tags = f.prefix .. 'groups', f.prefix .. 'tags'
  for _, x in ipairs(cands) do
    if x.take > 0 then
      local start = x.s0 + (got[x.g] or 0) / x.w
      if x.n > x.popped then
        redis.call('ZADD', groups, start, x.g)
      else
        redis.call('ZREM', groups, x.g)
        if start > f.v then redis.call('ZADD', tags, start, x.g) end
      end
    end
  end
  local out = {'v', tostring(f.v)}
  for _, field in ipairs({'swept', 'head', 'low', 'gaps'}) do
    if f.state[field] then out[#out + 1], out[#out + 2] = field, f.state[field] end
  end
  redis.call('HSET', f.prefix .. 'state', unpack(out))
  if had_gap and not f.state.gaps then redis.call('HDEL', f.prefix .. 'state', 'gaps') end
  return capped
end
