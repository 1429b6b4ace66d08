#!lua flags=allow-oom
-- ack.lua: finish claims whose refresh succeeded (one shard, one or more rules).
--
-- KEYS[1] meta   KEYS[2] next-wake   KEYS[3] history
-- KEYS[4+2g], KEYS[5+2g]   due:RULE and inflight:RULE of group g (g = 0, 1, ...)
-- ARGV[1] wake channel   ARGV[2] node id   ARGV[3] history length (0: none)
-- ARGV[4] TRACES-PREFIX (a key's trace contexts: the prefix and the key), or "" when
--         this node traces nothing (no key's contexts are deleted then)
-- then per group g: RULE, N, its N claims in one argument: "TOKEN|START|MS|KEY"
-- each (start and duration of the refresh in ms), joined by NUL characters (one
-- argument is far cheaper for the client to encode than four a claim), and BATCH:
-- the number of keys of the batch handler call whose claims the group holds, or ""
-- then, only when some group's rule has items: CLAIMED-PREFIX, and per group g "1" if
-- its rule has items (else "0"), from ARGV[5+4G] (G groups)
-- then, only when the call has a receipt: its key last in KEYS (acked:NODE) and its
-- call id last in ARGV
--
-- A claim is finished only by the holder of its fencing token: an ack that
-- carries an older token (the lease expired and the key was claimed again) is
-- refused and reported, so a paused holder can never ack over a newer claim.
-- A success of a rule with items deletes the key's claimed items (_lib.lua): they
-- were delivered; a stale ack leaves them to the claim that holds them now.
-- A key touched while it ran goes back to pending with its re-armed due time; a key
-- that is done (its state deleted) has its trace contexts deleted too.
-- Each refresh is appended to the history: outcome "success", or "lost" for a
-- refused (stale) ack; and to its key's timeline, as an "o" event (_lib.lua).
-- A call with a receipt leaves its id and answer there for RECEIPT_MS: the same call
-- replayed (its reply was lost to a connection reset, and the client sent it again)
-- finds it and gets the same answer, and changes nothing: its claims, acked by the
-- first try, are not reported as taken over. A batch group's successes share one entry: its fields
-- "keys" (NUL-joined), "tokens", "attempts" and "dues" (comma-joined, in the same
-- order) and "batch" (how many keys the handler call had) stand for one each.
-- Returns {acked, re-armed, stale keys...}, re-armed as the count of each group's keys
-- touched while they ran (a rerun each), comma-joined in group order ("0,2").

local meta, next_key, history = KEYS[1], KEYS[2], KEYS[3]
local node, maxlen = ARGV[2], tonumber(ARGV[3])
local acked, rearmed, stale, earliest, pos = 0, {}, {}, nil, 5
local traces_prefix = ARGV[4]
local now = now_ms()
local RECEIPT_MS = 60000
local receipt, call_id = false, nil
if (#KEYS - 3) % 2 == 1 then receipt, call_id = KEYS[#KEYS], ARGV[#ARGV] end

-- The answer recorded by the first try of this very call, if this is a replay.
local function replayed()
  if not receipt then return nil end
  local seen = redis.call('GET', receipt)
  if not seen then return nil end
  local parts = {}
  for part in string.gmatch(seen .. '\0', '([^%z]*)%z') do parts[#parts + 1] = part end
  if parts[1] ~= call_id then return nil end
  local answer = {tonumber(parts[2]), parts[3]}
  for i = 4, #parts do if parts[i] ~= '' then answer[#answer + 1] = parts[i] end end
  return answer
end

local again = replayed()
if again then return again end

-- The claims of a group's argument, as four lists: keys, tokens, starts, durations.
local function claims_of(joined, n)
  local keys, tokens, starts, took, i = {}, {}, {}, {}, 0
  for token, start, ms, key in string.gmatch(joined, '(%d+)|(%-?%d+)|(%-?%d+)|([^%z]*)') do
    i = i + 1
    keys[i], tokens[i], starts[i], took[i] = key, token, start, ms
  end
  if i ~= n then error('ack: ' .. n .. ' claims announced, ' .. i .. ' given') end
  return keys, tokens, starts, took
end

-- Whether the claim `v` (a meta value) is running under `token` (false: a stale
-- holder), then its attempt and due time as text (for the history), then the whole
-- claim decoded when it holds a touch to re-arm. The usual case, no touch while it
-- ran, is one pattern match: no decode, no number parsed.
local function held_by(v, token)
  if not v then return false end
  local t, attempt, due, rdue = string.match(v, '^R|(%d+)|%d+|%d+|(%d+)|(%d+)|(%d*)|')
  if not t then  -- not running, or a running value of the older form
    local r = string.sub(v, 1, 1) == 'R' and decode(v)
    if not r or r.token ~= tonumber(token) then return false end
    return true, r.attempt, int(r.due), r
  end
  if tonumber(t) ~= tonumber(token) then return false end
  return true, attempt, due, rdue ~= '' and decode(v) or nil
end

-- A finished claim on its key's timeline (_lib.lua): `next` what follows, `size` the
-- batch handler call's keys (0: a refresh of its own).
local function on_timeline(key, token, outcome, start, ms, size, next, err)
  timeline_push(timeline_of(meta, key), 'o|' .. int(now) .. '|' .. token .. '|' .. outcome
                .. '|' .. start .. '|' .. ms .. '|' .. size .. '|' .. next .. '|' .. err)
end

-- One history entry for the successes of a batch handler call.
local function record_batch(rule, done, n, start, ms)
  if maxlen <= 0 or #done.keys == 0 then return end
  redis.call('XADD', history, 'MAXLEN', '~', maxlen, '*', 'keys',
             table.concat(done.keys, '\0'), 'rule', rule, 'node', node, 'tokens',
             table.concat(done.tokens, ','), 'attempts', table.concat(done.attempts, ','),
             'dues', table.concat(done.dues, ','), 'start', start, 'ms', ms, 'batch', n,
             'outcome', 'success')
end

local groups = math.floor((#KEYS - 3) / 2)
local claimed_prefix, item_flags = ARGV[5 + 4 * groups], 6 + 4 * groups
local seen = {}  -- a key given twice in one call is acked once; the second is stale
for g = 0, groups - 1 do
  local due_key, inflight_key = KEYS[4 + 2 * g], KEYS[5 + 2 * g]
  local rule, n = ARGV[pos], tonumber(ARGV[pos + 1])
  local size = tonumber(ARGV[pos + 3]) or 0
  local batched = size > 0
  local done = {keys = {}, tokens = {}, attempts = {}, dues = {}}
  local finished, forgotten, delivered = {}, {}, nil
  if claimed_prefix and ARGV[item_flags + g] == '1' then delivered = {} end
  local keys, tokens, starts, took = claims_of(ARGV[pos + 2], n)
  rearmed[g + 1] = 0
  local states = n > 0 and read_fields(meta, keys) or {}
  for j = 1, n do
    local key, token = keys[j], tokens[j]
    local held, attempt, due, r = false, nil, nil, nil
    if not seen[key] then held, attempt, due, r = held_by(states[j], token) end
    if held then
      seen[key] = true
      finished[#finished + 1] = key
      if delivered then delivered[#delivered + 1] = claimed_prefix .. key end
      local again = r and rearm(meta, due_key, key, r)
      on_timeline(key, token, 'success', starts[j], took[j], size,
                  again and 'again@' .. int(again) or '', '')
      if again then
        rearmed[g + 1] = rearmed[g + 1] + 1
        earliest = min(earliest, again)
      else
        forgotten[#forgotten + 1] = key
      end
      acked = acked + 1
      if batched then
        local d = #done.keys + 1
        done.keys[d], done.tokens[d], done.attempts[d], done.dues[d] = key, token, attempt, due
      else
        record(history, maxlen, key, rule, node, token, attempt, due, starts[j], took[j],
               'success')
      end
    else
      stale[#stale + 1] = key
      record(history, maxlen, key, rule, node, token, '', '', starts[j], took[j], 'lost',
             'succeeded, but its claim had been taken over (lease expired)')
      on_timeline(key, token, 'lost', starts[j], took[j], size, '',
                  'succeeded, but its claim had been taken over (lease expired)')
    end
  end
  if batched and n > 0 then record_batch(rule, done, size, starts[1], took[1]) end
  each_chunk('ZREM', inflight_key, finished)
  each_chunk('HDEL', meta, forgotten)
  local traced = {}  -- the done keys' trace contexts
  if traces_prefix ~= '' then
    for i = 1, #forgotten do traced[i] = traces_prefix .. forgotten[i] end
  end
  for i = 1, #traced, CHUNK do
    redis.call('DEL', unpack(traced, i, math.min(i + CHUNK - 1, #traced)))
  end
  if delivered then
    for i = 1, #delivered, CHUNK do
      redis.call('DEL', unpack(delivered, i, math.min(i + CHUNK - 1, #delivered)))
    end
  end
  pos = pos + 4
end
wake(next_key, ARGV[1], earliest)
rearmed = table.concat(rearmed, ',')
if receipt then
  redis.call('SET', receipt, table.concat({call_id, acked, rearmed, unpack(stale)}, '\0'),
             'PX', RECEIPT_MS)
end
return {acked, rearmed, unpack(stale)}
