--[[
  Inspect: a consistent, read-only snapshot of one queue's keys (claimkit inspect, SPEC §8).

  Nothing is written: the script only reads, so all counts and rows describe one instant
  of the Redis server clock. Rows are the claims with the earliest lease expiry first
  (expired leases lead), at most `limit` of them.

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] claimed HASH           <q>:claimed
    KEYS[3] owners HASH            <q>:claim-owners
    KEYS[4] lease index ZSET       <q>:claims-idx
    KEYS[5] deliveries HASH        <q>:deliveries
    KEYS[6] dead ZSET              <q>:dead

    ARGV[1] limit: at most this many claim rows; 0 = every claim

  Output: { server_now (string, Unix seconds), pending, oldest pending score (string)
    or nil, claims (index entries), expired (index entries with expiry <= server_now),
    dead, redelivered (fields of the deliveries hash), then six per claim row:
      id, lease expiry (string, Unix seconds), owner token or nil,
      original pending score (string) or nil, deliveries (string) or nil,
      1 when the claimed payload exists else 0 }
]]
-- @include _server-now

local limit = tonumber(ARGV[1])
local now = server_now()
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local out = {
  fmt_time(now),
  redis.call('ZCARD', KEYS[1]),
  oldest[2] or false,
  redis.call('ZCARD', KEYS[4]),
  redis.call('ZCOUNT', KEYS[4], '-inf', fmt_time(now)),
  redis.call('ZCARD', KEYS[6]),
  redis.call('HLEN', KEYS[5]),
}
local rows = redis.call('ZRANGE', KEYS[4], 0, limit - 1, 'WITHSCORES')
for i = 1, #rows, 2 do
  local id = rows[i]
  out[#out + 1] = id
  out[#out + 1] = rows[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[3], id) or false
  out[#out + 1] = redis.call('HGET', KEYS[2], id .. ':score') or false
  out[#out + 1] = redis.call('HGET', KEYS[5], id) or false
  out[#out + 1] = redis.call('HEXISTS', KEYS[2], id)
end
return out
