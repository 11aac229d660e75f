-- Include: fail before the first write when one of the script's KEYS holds another type.
--
-- A script that fails keeps every write it made before the failure (Redis has no
-- rollback), so a key of another type met half-way could drop a claim without putting
-- its request back anywhere. guard_keys('zset', 'hash', ...) names the types of KEYS[1],
-- KEYS[2], ... in order; a missing key passes. A key of another type fails the script with
-- Redis's own WRONGTYPE error before anything is written.
local GUARD_COMMAND = { zset = 'ZCARD', hash = 'HLEN', list = 'LLEN' }
local function guard_keys(...)
  local kinds = { ... }
  for i = 1, #kinds do
    redis.call(GUARD_COMMAND[kinds[i]], KEYS[i])
  end
end
