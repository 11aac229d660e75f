-- Include: a consumer's entry in the consumer registry (docs/protocol.md#consumers), the
-- one copy: lua/register-2.lua and lua/renew-4.lua write it.
--
-- consumer_args(i): ARGV[i .. i+4] checked, before any write: consumer id (1 to 127
-- characters of [A-Za-z0-9._-], the first a letter or digit: CONSUMER_ID_PATTERN in
-- claimkit/protocol/tokens.py), liveness ttl (seconds, a number > 0), host (text), pid (a
-- whole number >= 0), version (text). Returns them as a table.
-- mark_alive(consumers, info, c, now, replace_info): consumers[c.id] = now + c.ttl (the
-- liveness expiry, Unix seconds, server clock; a plain ZADD, so an entry a reclaimer had
-- marked dead, score negated, is alive again), and info[c.id] = JSON {host, pid, started =
-- now, version} when replace_info or when the consumer has no info yet.
-- @include _checks

local function consumer_args(i)
  local id = ARGV[i]
  if not id or #id > 127 or not string.match(id, '^[A-Za-z0-9][A-Za-z0-9._-]*$') then
    error('claimkit: ARGV[' .. i .. '] must be a consumer id ([A-Za-z0-9][A-Za-z0-9._-]{0,126}), got '
      .. tostring(id))
  end
  local ttl = number_arg(i + 1)
  if ttl <= 0 then
    error('claimkit: ARGV[' .. (i + 1) .. '] must be a number > 0, got ' .. tostring(ARGV[i + 1]))
  end
  return { id = id, ttl = ttl, host = ARGV[i + 2] or '', pid = count_arg(i + 3, 0),
    version = ARGV[i + 4] or '' }
end

local function mark_alive(consumers, info, c, now, replace_info)
  redis.call('ZADD', consumers, string.format('%.6f', now + c.ttl), c.id)
  if replace_info or redis.call('HEXISTS', info, c.id) == 0 then
    redis.call('HSET', info, c.id,
      cjson.encode({ host = c.host, pid = c.pid, started = now, version = c.version }))
  end
end
