--[[
  Claim a batch of peeked members under a lease (docs/protocol.md#claim).

  For each candidate: if it is no longer pending, another consumer won (not pending). If
  the id already has a claim (or its fields would collide with one: ids "x" and "x:score" share
  the claimed hash), it is left pending (busy: a second generation of a reused id waits for
  the first to finish). Otherwise ZREM it from pending and record the claim.
  Lease expiry (lua/_lease.lua) = min(server_now + lease_ttl, deadline + 30), but never less
  than server_now + min(lease_ttl, 30): a request whose deadline already passed is claimed
  only to be acked with DEADLINE_EXCEEDED, and must not be reclaimable before that ack.

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] claimed HASH           <q>:claimed
    KEYS[3] owners HASH            <q>:claim-owners
    KEYS[4] lease index ZSET       <q>:claims-idx

    ARGV[1] lease ttl, seconds (float)
    ARGV[2] cancel key prefix      "request-cancel:", or "" to read no cancel key (Redis
            Cluster: the marker lives in the request's own slot; the caller reads it after
            the claim, MGET per slot,
            docs/topology.md#retries-cancellation-and-the-producer)
    then five per candidate, repeated:
      member       exact member bytes
      id           data.id
      token        fresh ownership token (hex)
      deadline     data.deadline, Unix seconds
      request_token internal.request_token or "" (the request generation)

  Output: { server_now (string, Unix seconds), code_1, ..., code_n } where code is
    1 claimed, 2 claimed and found cancelled (its request-cancel marker,
    docs/protocol.md#keys), 0 not pending (another consumer claimed it first, or it was
    acked or moved), 3 busy (the id has a live claim; left pending).
]]
-- @include _server-now
-- @include _guard-keys
-- @include _checks
-- @include _lease

guard_keys('zset', 'hash', 'hash', 'zset')

local lease_ttl = number_arg(1)
for i = 3, #ARGV, 5 do number_arg(i + 3) end -- every deadline, before the first write
local cancel_prefix = ARGV[2]
local now = server_now()
local out = { fmt_time(now) }

for i = 3, #ARGV, 5 do
  local member, id, token = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local deadline, request_token = tonumber(ARGV[i + 3]), ARGV[i + 4]
  local code = 0
  local score = redis.call('ZSCORE', KEYS[1], member)
  if not score then
    code = 0
  elseif redis.call('HEXISTS', KEYS[3], id) == 1
      or redis.call('HEXISTS', KEYS[2], id) == 1
      or redis.call('HEXISTS', KEYS[2], id .. ':score') == 1 then
    code = 3
  else
    redis.call('ZREM', KEYS[1], member)
    redis.call('HSET', KEYS[2], id, member, id .. ':score', score)
    redis.call('HSET', KEYS[3], id, token)
    redis.call('ZADD', KEYS[4], lease_expiry(now, lease_ttl, deadline), id)
    code = 1
    -- A cancel key of another type cannot hold the token: not cancelled (guarded_get).
    if cancel_prefix ~= '' and request_token ~= ''
        and guarded_get(cancel_prefix .. id) == request_token then
      code = 2
    end
  end
  out[#out + 1] = code
end
return out
