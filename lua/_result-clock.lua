-- Include: the Redis server clock in whole milliseconds, as durable result readers score
-- their leases and tombstones (docs/results.md#keys): TIME seconds * 1000 plus the
-- microseconds floored to milliseconds. llm-d-async's result readers score them the same.
-- ms_arg(n): a score to send back to Redis, as a decimal integer string (never 1.7e+12).
local function server_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function ms_arg(n)
  return string.format('%d', n)
end

-- owner_arg(i): ARGV[i] as a non-empty owner token, or fail (before the first write).
local function owner_arg(i)
  local v = ARGV[i]
  if v == nil or v == '' then
    error('claimkit: ARGV[' .. i .. '] (owner token) must not be empty')
  end
  return v
end

-- drop_expired(key, now, limit): remove up to limit members of the sorted set key whose
-- score is <= now (the bounded tombstone cleanup).
local function drop_expired(key, now, limit)
  local old = redis.call('ZRANGEBYSCORE', key, '-inf', ms_arg(now), 'LIMIT', 0, limit)
  if #old > 0 then redis.call('ZREM', key, unpack(old)) end
end
