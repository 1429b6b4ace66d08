-- reshard_take.lua: take keys out of their old shard for a running reshard.
--
-- KEYS[1] meta   KEYS[2] moving   KEYS[3] seq   KEYS[4] layout marker
-- KEYS[5] rulenames (the shard's rule names: where a key's due or dead entry is)
-- ARGV[1] the reshard's layout generation   ARGV[2] the shard's key prefix
-- ARGV[3] N   ARGV[4] the N keys joined by NUL   ARGV[5] their N new shards, joined so
-- ARGV[6] the caller's rule names joined by NUL (looked at too: a rule only writers
--         know is in no rulenames set)
--
-- First raises the shard's marker to the generation: from then on a writer of an
-- older layout is sent to read the layout again (upsert.lua), so no key can be
-- written here by the old mapping any more. Then, per key: a pending or dead key is
-- taken whole (its state, its due or dead score, its items and claimed items) into
-- `moving`, as a JSON bundle with an id of its own, and out of every other key of the
-- shard; a running key
-- stays (it finishes here, and is taken once pending again); a key with no state is
-- skipped. reshard_put.lua puts bundles into their new shard, and the mover then
-- deletes them from `moving`; a mover that dies in between leaves them there, and
-- the shard's next mover puts them first.
-- Returns {0, MARKER} if the marker is newer than the generation (the caller is
-- stale), else {1, SEQ (the shard's fencing tokens so far), {KEY, BUNDLE, ...},
-- {running key, ...}}.

local gen = tonumber(ARGV[1])
local marker = tonumber(redis.call('GET', KEYS[4]) or 1)
if marker > gen then return {0, marker} end
if marker < gen then redis.call('SET', KEYS[4], gen) end
local prefix, keys = ARGV[2], split_keys(ARGV[4], tonumber(ARGV[3]))
local dests = split_keys(ARGV[5], tonumber(ARGV[3]))
local rules = redis.call('SMEMBERS', KEYS[5])
if ARGV[6] ~= '' then
  local known = {}
  for _, r in ipairs(rules) do known[r] = true end
  local _, n = string.gsub(ARGV[6], '%z', '')
  for _, r in ipairs(split_keys(ARGV[6], n + 1)) do
    if not known[r] then rules[#rules + 1] = r end
  end
end

-- The rule whose due (or dead) set holds `key`, and its score there.
local function find(key, kind)
  for _, rule in ipairs(rules) do
    local score = redis.call('ZSCORE', prefix .. ':' .. kind .. ':' .. rule, key)
    if score then return rule, score end
  end
  return nil, nil
end

local t = redis.call('TIME')
local stamp = t[1] .. t[2] .. ':' .. prefix .. ':'  -- with `i`, a bundle's unique id
local bundles, busy = {}, {}
for i, key in ipairs(keys) do
  local v = redis.call('HGET', KEYS[1], key)
  if v and string.sub(v, 1, 1) == 'R' then
    busy[#busy + 1] = key
  elseif v then
    local kind = string.sub(v, 1, 1) == 'D' and 'dead' or 'due'
    local rule, score = find(key, kind)
    local items, claimed = prefix .. ':items:' .. key, prefix .. ':claimed:' .. key
    local b = cjson.encode({id = stamp .. i, k = key, d = tonumber(dests[i]), r = rule or '', v = v, z = score or '',
                            i = redis.call('SMEMBERS', items),
                            c = redis.call('SMEMBERS', claimed)})
    redis.call('HSET', KEYS[2], key, b)
    redis.call('HDEL', KEYS[1], key)
    if rule then redis.call('ZREM', prefix .. ':' .. kind .. ':' .. rule, key) end
    redis.call('DEL', items, claimed)
    bundles[#bundles + 1], bundles[#bundles + 2] = key, b
  end
end
return {1, tonumber(redis.call('GET', KEYS[3]) or 0), bundles, busy}
