--[[
  Heartbeat: renew the leases of the claims one owner holds, fenced by token
  (docs/protocol.md#heartbeat).

  Bulk commands, not one pair per claim: owners are read with one HMGET and leases written
  with one ZADD per step of 1000 claims. A call costs about 2-3.5 us of Redis time per claim,
  so the caller sends at most 1000 claims per call (RENEW_CHUNK), several calls pipelined in
  one round trip per tick (docs/performance.md, "Heartbeat").

  Input:
    KEYS[1] owners HASH            <q>:claim-owners
    KEYS[2] lease index ZSET       <q>:claims-idx

    ARGV[1] lease ttl, seconds (float)
    then three per claim, repeated:
      id, token (the caller's ownership token), deadline (Unix seconds)

  Output: { server_now (string, Unix seconds), code_1, ..., code_n } where code is
    1 renewed (lua/_lease.lua: the lease becomes lease_bound = min(now + ttl,
    deadline + 30), and is never shortened, ZADD GT: a claim whose deadline passed keeps
    the floor its claim granted, then lapses), 0 gone (acked, released or reclaimed),
    -1 taken by another token.
]]
-- @include _server-now
-- @include _guard-keys
-- @include _checks
-- @include _lease

guard_keys('hash', 'zset')

local lease_ttl = number_arg(1)
for i = 4, #ARGV, 3 do number_arg(i) end -- every deadline, before the first write
local now = server_now()
local out = { fmt_time(now) }
local n = (#ARGV - 1) / 3
local STEP = 1000 -- keeps unpack() far below Lua's C stack limit (8000)

for first = 0, n - 1, STEP do
  local last = math.min(n - 1, first + STEP - 1)
  local ids = {}
  for j = first, last do
    ids[#ids + 1] = ARGV[2 + 3 * j]
  end
  local owners = redis.call('HMGET', KEYS[1], unpack(ids))
  local leases = {}
  for k = 1, #ids do
    local j = first + k - 1
    local owner = owners[k]
    local code = 0
    if owner == ARGV[3 + 3 * j] then
      leases[#leases + 1] = lease_bound(now, lease_ttl, tonumber(ARGV[4 + 3 * j]))
      leases[#leases + 1] = ids[k]
      code = 1
    elseif owner then
      code = -1
    end
    out[#out + 1] = code
  end
  if #leases > 0 then
    redis.call('ZADD', KEYS[2], 'GT', unpack(leases))
  end
end
return out
