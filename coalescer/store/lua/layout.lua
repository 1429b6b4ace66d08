-- layout.lua: read the namespace's shard layout, creating it on first use.
--
-- KEYS[1] layout (HASH: gen, shards, from, began, ended, moved, by, was)
-- KEYS[2] drained (SET of the old shards a running reshard has emptied)
-- ARGV[1] the shard count to start with when there is no layout yet (generation 1:
--         every shard's data was written under it, as before layouts existed)
--
-- Returns {gen, shards, from (0: no reshard runs), began ms, ended ms, moved,
--          by (the node that began the last reshard), {drained shard, ...},
--          was (the count the last reshard that ended came from, else 0)}.

if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'gen', 1, 'shards', ARGV[1], 'from', 0)
end
local l = redis.call('HMGET', KEYS[1], 'gen', 'shards', 'from', 'began', 'ended', 'moved', 'by',
                    'was')
return {tonumber(l[1]), tonumber(l[2]), tonumber(l[3] or 0), tonumber(l[4] or 0),
        tonumber(l[5] or 0), tonumber(l[6] or 0), l[7] or '', redis.call('SMEMBERS', KEYS[2]),
        tonumber(l[8] or 0)}
