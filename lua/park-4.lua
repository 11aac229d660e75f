--[[
  Park for retry: move claims to the retry set, fenced by token (docs/protocol.md#park-for-retry).

  The retry set becomes the request's only home: the claim is deleted in the same step.

  Input:
    KEYS[1] claimed HASH           <q>:claimed
    KEYS[2] owners HASH            <q>:claim-owners
    KEYS[3] lease index ZSET       <q>:claims-idx
    KEYS[4] retry ZSET             retry-sortedset

    then four per request, repeated:
      id, token (ownership token), delay (backoff, seconds, float),
      retry_member (envelope with internal.retry_count + 1 and request_queue_name set)

  Output: { server_now (string), code_1, ..., code_n } where code is 1 parked (score =
    server_now + delay) or 0 not parked (the caller no longer owns the claim).
]]
-- @include _server-now
-- @include _drop-claim
-- @include _guard-keys
-- @include _checks

guard_keys('hash', 'hash', 'zset', 'zset')
for i = 1, #ARGV, 4 do number_arg(i + 2) end -- every delay, before the first write

local now = server_now()
local out = { fmt_time(now) }

for i = 1, #ARGV, 4 do
  local id, token = ARGV[i], ARGV[i + 1]
  local code = 0
  if redis.call('HGET', KEYS[2], id) == token then
    redis.call('ZADD', KEYS[4], string.format('%.17g', now + tonumber(ARGV[i + 2])), ARGV[i + 3])
    drop_claim(KEYS[1], KEYS[2], KEYS[3], id)
    code = 1
  end
  out[#out + 1] = code
end
return out
