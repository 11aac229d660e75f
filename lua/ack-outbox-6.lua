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
-- @include _live-copy
-- @include _outbox
-- @include _guard-keys

guard_keys('zset', 'hash', 'hash', 'zset', 'hash', 'hash')

local out = {}

for i = 1, #ARGV, 7 do
  local id, field = ARGV[i], ARGV[i + 6]
  local code = 3
  if redis.call('HEXISTS', KEYS[6], field) == 0 then
    code = take_live_copy(id, ARGV[i + 1], ARGV[i + 5])
    if code ~= 0 then outbox_put(KEYS[6], field, ARGV[i + 3], ARGV[i + 2], ARGV[i + 4], id) end
  end
  out[#out + 1] = code
end
return out
