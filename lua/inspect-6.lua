--[[
  Inspect: a consistent, read-only snapshot of one queue's keys (claimkit inspect, docs/cli.md).

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
    ARGV[2] scan_max: at most this many fields of each claim hash are read to count the
            claims without a lease entry (orphans); 0 = no bound

  Output: { server_now (string, Unix seconds), pending, oldest pending score (string)
    or nil, leases (index entries), expired (index entries with expiry <= server_now),
    dead, redelivered (fields of the deliveries hash), claims (owner entries, plus payloads
    that have neither an owner nor a lease entry), orphans (claims without a lease entry:
    owner entries, or such payloads), 1 when claims and orphans are exact (0: a hash was
    larger than scan_max; both are then lower bounds), then six per claim row:
      id, lease expiry (string, Unix seconds), owner token or nil,
      original pending score (string) or nil, deliveries (string) or nil,
      1 when the claimed payload exists else 0 }
]]
-- @flags no-writes
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
-- Claims without a lease entry (docs/protocol.md, "Claims without a lease entry").
local scan_max = tonumber(ARGV[2]) or 0
local exact = 1
local function each_field(key, fn)
  local cursor, read = '0', 0
  repeat
    if scan_max > 0 and read >= scan_max then exact = 0; return end
    local page = redis.call('HSCAN', key, cursor, 'COUNT', 1000)
    cursor = page[1]
    for j = 1, #page[2], 2 do fn(page[2][j], page[2][j + 1]) end
    read = read + #page[2] / 2
  until cursor == '0'
end
local orphans, loose = 0, 0
each_field(KEYS[3], function(id)
  if not redis.call('ZSCORE', KEYS[4], id) then orphans = orphans + 1 end
end)
each_field(KEYS[2], function(field, value)
  local base = string.match(field, '^(.*):score$')
  if base and (redis.call('HEXISTS', KEYS[2], base) == 1 or tonumber(value)) then return end
  if redis.call('HEXISTS', KEYS[3], field) == 0 and not redis.call('ZSCORE', KEYS[4], field) then
    orphans, loose = orphans + 1, loose + 1
  end
end)
out[#out + 1] = redis.call('HLEN', KEYS[3]) + loose
out[#out + 1] = orphans
out[#out + 1] = exact

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
