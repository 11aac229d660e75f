-- Include: the Redis server clock as Unix seconds (float). Every lease and due time in
-- claimkit is read from here, never from a worker's clock (docs/protocol.md#keys).
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Scores go back to Python as strings: a Lua number in a reply is truncated to an integer.
local function fmt_time(t)
  return string.format('%.6f', t)
end
