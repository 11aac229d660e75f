--[[
  Consumers: a read-only view of one queue's consumer registry and of who holds its claims
  (claimkit consumers, claimkit inspect; docs/protocol.md#consumers).

  Nothing is written. A claim's consumer is the part of its ownership token before the last
  "/"; tokens without one count as unknown. Consumers that hold claims but have no registry
  entry (forgotten, or the registry is off) are listed too, with no score.

  Input:
    KEYS[1] consumer registry ZSET <q>:consumers
    KEYS[2] consumer info HASH     <q>:consumer-info
    KEYS[3] owners HASH            <q>:claim-owners

    ARGV[1] scan_max: at most this many fields of <q>:claim-owners are read; 0 = no bound

  Output: { server_now (string, Unix seconds), 1 when the claim counts are exact (0: the
    owners hash was larger than scan_max), unknown claims, the oldest unknown token that
    is 32 hex chars or nil, then five per consumer, registry entries first (by score), then
    the others by id:
      id, score (string: liveness expiry, Unix seconds; negative: marked dead by a
      reclaimer) or nil, info JSON or nil, claims held, the hex part of its oldest claim's
      token (the least, the UUIDv7 sorts by time) or nil }
]]
-- @flags no-writes
-- @include _server-now

local scan_max = tonumber(ARGV[1]) or 0
local now = server_now()
local held, oldest = {}, {}
local unknown, unknown_oldest = 0, nil
local exact, cursor, read = 1, '0', 0
repeat
  if scan_max > 0 and read >= scan_max then exact = 0; break end
  local page = redis.call('HSCAN', KEYS[3], cursor, 'COUNT', 1000)
  cursor = page[1]
  for j = 2, #page[2], 2 do
    local token = page[2][j]
    local consumer, rest = string.match(token, '^(.*)/([^/]*)$')
    if consumer and consumer ~= '' then
      held[consumer] = (held[consumer] or 0) + 1
      if not oldest[consumer] or rest < oldest[consumer] then oldest[consumer] = rest end
    else
      unknown = unknown + 1
      if #token == 32 and not string.find(token, '[^0-9a-f]')
        and (not unknown_oldest or token < unknown_oldest) then
        unknown_oldest = token
      end
    end
  end
  read = read + #page[2] / 2
until cursor == '0'

local out = { fmt_time(now), exact, unknown, unknown_oldest or false }
local listed = {}
local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #entries, 2 do
  local id = entries[i]
  listed[id] = true
  out[#out + 1] = id
  out[#out + 1] = entries[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], id) or false
  out[#out + 1] = held[id] or 0
  out[#out + 1] = oldest[id] or false
end
local others = {}
for id in pairs(held) do
  if not listed[id] then others[#others + 1] = id end
end
table.sort(others)
for _, id in ipairs(others) do
  out[#out + 1] = id
  out[#out + 1] = false
  out[#out + 1] = redis.call('HGET', KEYS[2], id) or false
  out[#out + 1] = held[id]
  out[#out + 1] = oldest[id]
end
return out
