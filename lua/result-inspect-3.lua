--[[
  Durable result delivery, inspect: a result list's reader state in one instant, writing
  nothing (``claimkit inspect``, docs/results.md#keys).

  Input:
    KEYS[1] result LIST          L
    KEYS[2] lease index ZSET     L:result-claims-idx
    KEYS[3] tombstones ZSET      L:result-ack-tombstones
    ({L}:... in the cluster layout)

    ARGV[] none

  Output: { pending (LLEN), leased (ZCARD index), expired (leases <= server now ms),
    tombstones (live: expiry > server now ms) }.
]]
-- @flags no-writes
-- @include _guard-keys
-- @include _result-clock

guard_keys('list', 'zset', 'zset')
local now = server_now_ms()
return {
  redis.call('LLEN', KEYS[1]),
  redis.call('ZCARD', KEYS[2]),
  redis.call('ZCOUNT', KEYS[2], '-inf', ms_arg(now)),
  redis.call('ZCOUNT', KEYS[3], '(' .. ms_arg(now), '+inf'),
}
