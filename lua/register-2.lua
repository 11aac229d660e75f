--[[
  Register: a consumer enters the consumer registry of one queue as it starts
  (docs/protocol.md#consumers).

  Input:
    KEYS[1] consumer registry ZSET <q>:consumers
    KEYS[2] consumer info HASH     <q>:consumer-info

    ARGV[1] consumer id
    ARGV[2] liveness ttl, seconds (a number > 0)
    ARGV[3] host name
    ARGV[4] process id (a whole number)
    ARGV[5] claimkit version

  Writes <q>:consumers[id] = server_now + ttl (the liveness expiry, Unix seconds) and
  <q>:consumer-info[id] = JSON {"host", "pid", "started": server_now, "version"}, replacing
  what an earlier consumer of the same id left there.

  Output: server_now (string, Unix seconds)
]]
-- @include _server-now
-- @include _guard-keys
-- @include _liveness

guard_keys('zset', 'hash')
local c = consumer_args(1)
local now = server_now()
mark_alive(KEYS[1], KEYS[2], c, now, true)
return fmt_time(now)
