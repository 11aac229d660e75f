--[[
  Drop dedup markers: delete the markers of request generations from one result list's
  marker set, in the list's slot (cluster layout only: claimkit dead requeue,
  docs/topology.md#cluster-key-layout). Standalone markers (result-terminal:<id>) are
  deleted by lua/requeue-dead-3.lua itself.

  A marker is deleted, with its expiry entry, only when it holds the given token (the
  generation's internal.request_token, or "1" when it has none): a marker another
  generation of the same id wrote is left alone.

  Input:
    KEYS[1] marker HASH            {L}:result-terminal
    KEYS[2] marker expiry ZSET     {L}:result-terminal-expiry

    then per marker, repeated: ARGV id, token

  Output: how many markers were deleted.
]]
-- @include _guard-keys

guard_keys('hash', 'zset')

local dropped = 0
for i = 1, #ARGV - 1, 2 do
  local id = ARGV[i]
  if redis.call('HGET', KEYS[1], id) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], id)
    redis.call('ZREM', KEYS[2], id)
    dropped = dropped + 1
  end
end
return dropped
