-- Include: reads that cannot fail on a key of another type, done before the first write.
--
-- A script that fails keeps every write it made before the failure (Redis has no
-- rollback), so a key of another type met half-way could drop a claim without putting
-- its request back anywhere.
--
-- guard_keys('zset', 'hash', ...) names the types of KEYS[1], KEYS[2], ... in order; a
-- missing key passes. A key of another type fails the script with Redis's own WRONGTYPE
-- error before anything is written.
-- guarded_get(key): GET key when it holds a string, else nil. For the per-request markers a
-- script reads by name (result-terminal:<id>, request-cancel:<id>): claimkit only ever SETs
-- strings there, so a key of another type is no marker, and a GET on it would fail the
-- script after its earlier writes.
local GUARD_COMMAND = { zset = 'ZCARD', hash = 'HLEN', list = 'LLEN' }
local function guard_keys(...)
  local kinds = { ... }
  for i = 1, #kinds do
    redis.call(GUARD_COMMAND[kinds[i]], KEYS[i])
  end
end

local function guarded_get(key)
  if redis.call('TYPE', key)['ok'] == 'string' then return redis.call('GET', key) end
  return nil
end
