-- Include: the dedup markers of one destination list L in the cluster layout
-- (docs/topology.md#dedup-markers-per-destination), kept in L's slot:
--   marker hash  {L}:result-terminal         <id> -> request_token, or "1" when it has none
--   expiry zset  {L}:result-terminal-expiry  <id> scored by when the marker expires (Unix
--                seconds, server clock); no entry: the marker never expires (dedup ttl 0)
-- A marker whose expiry has passed counts as absent. No HEXPIRE (Redis 7.4+): this works on
-- every server claimkit supports.
--
-- markers_usable(hkey, zkey): whether the two keys hold a hash and a sorted set (or do not
-- exist). A key of another type is no marker set of claimkit's: the caller treats the list
-- as unusable rather than overwrite a key somebody else wrote.
-- marker_get(hkey, zkey, id, now): the marker's value, or nil (absent or expired).
-- push_marked(rkey, hkey, zkey, id, record, request_token, dedup_ttl, now): LPUSH record
--   onto rkey and set the marker, unless the marker says the record is already there
--   (lua/_dedup.lua); 1 pushed, 0 suppressed. The caller has checked every key's type.
-- sweep_markers(hkey, zkey, now): remove up to 100 expired markers (bounded cleanup: a burst
--   of old markers goes in a few pushes).
-- @include _dedup

local function markers_usable(hkey, zkey)
  local h, z = redis.call('TYPE', hkey)['ok'], redis.call('TYPE', zkey)['ok']
  return (h == 'hash' or h == 'none') and (z == 'zset' or z == 'none')
end

local function marker_get(hkey, zkey, id, now)
  local value = redis.call('HGET', hkey, id)
  if not value then return nil end
  local expiry = tonumber(redis.call('ZSCORE', zkey, id))
  if expiry and expiry <= now then return nil end
  return value
end

local function push_marked(rkey, hkey, zkey, id, record, request_token, dedup_ttl, now)
  if is_duplicate(marker_get(hkey, zkey, id, now), request_token) then return 0 end
  redis.call('LPUSH', rkey, record)
  local value = request_token
  if value == '' then value = '1' end
  redis.call('HSET', hkey, id, value)
  if dedup_ttl > 0 then
    redis.call('ZADD', zkey, string.format('%.17g', now + dedup_ttl), id)
  else
    redis.call('ZREM', zkey, id)
  end
  return 1
end

local function sweep_markers(hkey, zkey, now)
  local cutoff = string.format('%.17g', now)
  local old = redis.call('ZRANGE', zkey, '-inf', cutoff, 'BYSCORE', 'LIMIT', 0, 100)
  if #old > 0 then
    redis.call('HDEL', hkey, unpack(old))
    redis.call('ZREM', zkey, unpack(old))
  end
end
