--[[
  Ack across slots, step 1: move each claim into the queue's outbox with its record, fenced
  (docs/topology.md#acks-across-slots). The record is pushed by lua/push-result-3.lua in
  the list's slot (step 2), then the caller deletes the outbox field (step 3); any
  reclaimer replays entries left behind.

  The live-copy rule is ack-5's: the entry is written only together with the removal of
  the request's one live copy, so the request is never both on its way to a record and
  still pending, claimed or parked:
  - the caller's token still owns the claim: the claim's entries and its delivery count are
    deleted (out of the lease index: no reclaimer can redeliver it, it never runs again);
  - the caller lost the claim but the exact member is back in pending: that copy is
    withdrawn;
  - otherwise the record is suppressed (a late result of a request that lives on elsewhere).
  Idempotent: when the outbox already holds the field <id>\0<token> (an earlier call whose
  reply was lost), nothing is written and the answer is "already moved".

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] claimed HASH           {q}:claimed
    KEYS[3] owners HASH            {q}:claim-owners
    KEYS[4] lease index ZSET       {q}:claims-idx
    KEYS[5] deliveries HASH        {q}:deliveries
    KEYS[6] outbox HASH            {q}:outbox

    then seven per request, repeated:
      id, token (ownership token), request_token (internal.request_token or ""),
      result_list (its destination, any slot), record (JSON), member (the exact claimed
      bytes), outbox field (<id>\0<token>)

  Output: { code_1, ..., code_n } where code is 1 moved (the caller's claim, deleted),
    2 moved (the pending copy withdrawn), 3 already in the outbox, 0 suppressed (nothing
    written). The entry is cjson {"list", "request_token", "record", "id"}.
]]
-- @include _drop-claim
-- @include _guard-keys

guard_keys('zset', 'hash', 'hash', 'zset', 'hash', 'hash')

local out = {}

for i = 1, #ARGV, 7 do
  local id, token, request_token = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local field = ARGV[i + 6]
  local code = 0
  if redis.call('HEXISTS', KEYS[6], field) == 1 then
    code = 3
  elseif redis.call('HGET', KEYS[3], id) == token then
    drop_claim(KEYS[2], KEYS[3], KEYS[4], id)
    code = 1
  elseif redis.call('ZREM', KEYS[1], ARGV[i + 5]) == 1 then
    code = 2
  end
  if code == 1 or code == 2 then
    redis.call('HDEL', KEYS[5], id)
    redis.call('HSET', KEYS[6], field, cjson.encode({
      list = ARGV[i + 3], request_token = request_token, record = ARGV[i + 4], id = id,
    }))
  end
  out[#out + 1] = code
end
return out
