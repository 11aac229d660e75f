--[[
  Heartbeat: renew the leases of the claims one owner holds, fenced by token, and the
  owner's liveness entry in the consumer registry, in the same call
  (docs/protocol.md#heartbeat, docs/protocol.md#consumers).

  Bulk commands, not one pair per claim: owners are read with one HMGET and leases written
  with one ZADD per step of 1000 claims. A call costs about 2-3.5 us of Redis time per claim,
  so the caller sends at most 1000 claims per call (RENEW_CHUNK), several calls pipelined in
  one round trip per tick (docs/performance.md, "Heartbeat"); the first call of a tick
  carries the consumer id, the others "". The heartbeat's liveness ticks, between two
  claims renewals, make one call with no claims: the liveness entry alone
  (QueueOps.renew_liveness).

  Input:
    KEYS[1] owners HASH            <q>:claim-owners
    KEYS[2] lease index ZSET       <q>:claims-idx
    KEYS[3] consumer registry ZSET <q>:consumers
    KEYS[4] consumer info HASH     <q>:consumer-info

    ARGV[1] lease ttl, seconds (float)
    ARGV[2] consumer id, or "" to leave the registry alone (the registry is off, or not
            this call of the tick's pipeline); then ARGV[3..6] are not read
    ARGV[3] liveness ttl, seconds (a number > 0)
    ARGV[4] host name, ARGV[5] process id, ARGV[6] claimkit version: the consumer's info,
            written only when <q>:consumer-info has none for it (lost, or forgotten by an
            operator while the consumer was alive), with "started" = server_now
    then three per claim, repeated:
      id, token (the caller's ownership token), deadline (Unix seconds)

  Output: { server_now (string, Unix seconds), code_1, ..., code_n } where code is
    1 renewed (lua/_lease.lua: the lease becomes lease_bound = min(now + ttl,
    deadline + 30), and is never shortened, ZADD GT: a claim whose deadline passed keeps
    the floor its claim granted, then lapses), 0 gone (acked, released or reclaimed),
    -1 taken by another token.
    With a consumer id, <q>:consumers[id] becomes server_now + liveness ttl (a plain ZADD:
    an entry a reclaimer had marked dead is alive again).
]]
-- @include _server-now
-- @include _guard-keys
-- @include _checks
-- @include _lease
-- @include _liveness

guard_keys('hash', 'zset', 'zset', 'hash')

local FIRST = 7 -- ARGV index of the first claim's id
local lease_ttl = number_arg(1)
local consumer = nil
if ARGV[2] ~= '' then consumer = consumer_args(2) end
if (#ARGV - FIRST + 1) % 3 ~= 0 then
  error('claimkit: renew takes 6 arguments, then three per claim, got ' .. #ARGV)
end
for i = FIRST + 2, #ARGV, 3 do number_arg(i) end -- every deadline, before the first write
local now = server_now()
local out = { fmt_time(now) }
local n = (#ARGV - FIRST + 1) / 3
local STEP = 1000 -- keeps unpack() far below Lua's C stack limit (8000)

if consumer then mark_alive(KEYS[3], KEYS[4], consumer, now, false) end

for first = 0, n - 1, STEP do
  local last = math.min(n - 1, first + STEP - 1)
  local ids = {}
  for j = first, last do
    ids[#ids + 1] = ARGV[FIRST + 3 * j]
  end
  local owners = redis.call('HMGET', KEYS[1], unpack(ids))
  local leases = {}
  for k = 1, #ids do
    local j = first + k - 1
    local owner = owners[k]
    local code = 0
    if owner == ARGV[FIRST + 1 + 3 * j] then
      leases[#leases + 1] = lease_bound(now, lease_ttl, tonumber(ARGV[FIRST + 2 + 3 * j]))
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
