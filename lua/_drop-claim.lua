-- Include: delete every entry of one claim (docs/protocol.md#keys): claimed payload and score,
-- owner, index.
local function drop_claim(claimed_key, owners_key, index_key, id)
  redis.call('HDEL', claimed_key, id, id .. ':score')
  redis.call('HDEL', owners_key, id)
  redis.call('ZREM', index_key, id)
end
