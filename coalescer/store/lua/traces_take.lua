-- traces_take.lua: hand a refresh the trace contexts kept for its keys, and delete them
-- (traces_put.lua keeps them; one shard).
--
-- KEYS[i]   the traces key of a claimed key (keys.py ShardKeys.traces)
-- Returns each key's value ("DROPPED|FIRST|LAST|TRIED", see traces_put.lua), or false.

local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('GET', KEYS[i])
end
if #KEYS > 0 then redis.call('DEL', unpack(KEYS)) end
return out
