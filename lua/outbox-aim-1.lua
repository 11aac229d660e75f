--[[
  Re-aim outbox entries at another list (docs/topology.md#acks-across-slots): the push step
  found their list unusable (another type of key), so their records go to the fallback
  list. Only an entry still in the outbox is rewritten: one another replayer has finished
  and deleted stays deleted (an HSET would bring it back, and its record would be pushed
  to the new list a second time).

  Input:
    KEYS[1] outbox HASH            {q}:outbox

    then two per entry, repeated: outbox field (<id>\0<token>), the new entry (cjson
      {"list", "request_token", "record", "id"})

  Output: { code_1, ..., code_n } where code is 1 re-aimed, 0 gone.
]]
-- @include _guard-keys

guard_keys('hash')

local out = {}
for i = 1, #ARGV, 2 do
  local code = 0
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    code = 1
  end
  out[#out + 1] = code
end
return out
