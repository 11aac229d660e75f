-- Include: the cluster layout's outbox entry (docs/topology.md#acks-across-slots), the one
-- copy of its shape: lua/ack-local-9.lua, lua/ack-outbox-6.lua, lua/reclaim-cluster-7.lua
-- and lua/dead-letter-outbox-3.lua write it; claimkit.protocol.outbox.OutboxEntry reads it.
--
-- outbox_put(outbox_key, field, list, request_token, record, id): HSET the entry, cjson
--   {"list", "request_token", "record", "id"}, under field (<id>\0<token>).

local function outbox_put(outbox_key, field, list, request_token, record, id)
  redis.call('HSET', outbox_key, field, cjson.encode({
    list = list, request_token = request_token, record = record, id = id,
  }))
end
