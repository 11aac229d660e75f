--[[
  Heartbeat: renew the leases of the claims one owner holds, fenced by token (SPEC §3.3).

  Input:
    KEYS[1] owners HASH            <q>:claim-owners
    KEYS[2] lease index ZSET       <q>:claims-idx

    ARGV[1] lease ttl, seconds (float)
    then three per claim, repeated:
      id, token (the caller's ownership token), deadline (Unix seconds)

  Output: { server_now (string, Unix seconds), code_1, ..., code_n } where code is
    1 renewed (expiry = min(now + ttl, deadline + 30)), 0 gone (acked, released or
    reclaimed), -1 taken by another token.
]]
-- @include _server-now

local lease_ttl = tonumber(ARGV[1])
local now = server_now()
local out = { fmt_time(now) }

for i = 2, #ARGV, 3 do
  local id, token, deadline = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local owner = redis.call('HGET', KEYS[1], id)
  local code = 0
  if owner == token then
    redis.call('ZADD', KEYS[2], math.min(now + lease_ttl, deadline + 30), id)
    code = 1
  elseif owner then
    code = -1
  end
  out[#out + 1] = code
end
return out
