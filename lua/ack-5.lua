--[[
  Ack: push each terminal record once and drop its claim, in one step (docs/protocol.md#ack).

  A record is pushed (under the generation-aware dedup marker) only together with the
  removal of the request's one live copy, so a request is never both recorded and still
  pending, claimed or parked:
  - the caller's token still owns the claim: push, and delete the claim;
  - the caller lost the claim but the exact member is back in pending (swept, drained or
    reclaimed, and nobody took it yet): push, and withdraw that pending copy, so it is not
    run again;
  - otherwise the request lives on under another owner's claim or in the retry set, or is
    done: the caller's result is a late duplicate (a stalled owner whose lease lapsed) and
    is suppressed. Whoever holds the request now writes its record.

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] claimed HASH           <q>:claimed
    KEYS[3] owners HASH            <q>:claim-owners
    KEYS[4] lease index ZSET       <q>:claims-idx
    KEYS[5] deliveries HASH        <q>:deliveries

    ARGV[1] dedup ttl, whole seconds (0 = markers never expire)
    ARGV[2] fallback result list: where a record goes when its own list holds another type
    then eight per request, repeated:
      id, token (ownership token), request_token (internal.request_token or ""),
      marker_key (result-terminal:<id>), result_key (result list), record (JSON),
      member (the exact claimed bytes), payload_key (request-payload:<id>:<request_token>
      when the member names its payload key in internal.payload_ref, else "")

  The payload key is deleted together with the request's live copy (the record pushed or
  suppressed as a duplicate, the request finished either way); a late ack that finds no
  live copy deletes nothing: the request lives on and still needs its payload
  (docs/protocol.md#payload-references). Like the marker and the result list, the payload
  key comes in ARGV: a standalone server runs a script that names keys it did not declare
  (the cluster acks, which must declare every key, delete it after the script).

  Output: { pushed_1, owned_1, ..., pushed_n, owned_n } where pushed is 1 (record pushed)
    or 0 (suppressed: a duplicate, or a late result of a request that lives on elsewhere)
    and owned is 1 (claim deleted) or 0 (not ours any more).
]]
-- @include _push-terminal
-- @include _drop-claim
-- @include _guard-keys
-- @include _checks

guard_keys('zset', 'hash', 'hash', 'zset', 'hash')

local dedup_ttl, fallback = count_arg(1, 0), ARGV[2]
list_usable(fallback, 'the fallback result list')
local out = {}

for i = 3, #ARGV, 8 do
  local id, token, request_token = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local payload_key = ARGV[i + 7]
  local pushed, owned, ended = 0, 0, false
  if redis.call('HGET', KEYS[3], id) == token then
    pushed = push_terminal(ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], request_token, dedup_ttl, fallback)
    drop_claim(KEYS[2], KEYS[3], KEYS[4], id)
    redis.call('HDEL', KEYS[5], id)
    owned, ended = 1, true
  elseif redis.call('ZREM', KEYS[1], ARGV[i + 6]) == 1 then
    pushed = push_terminal(ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], request_token, dedup_ttl, fallback)
    redis.call('HDEL', KEYS[5], id)
    ended = true
  end
  if ended and payload_key ~= '' then redis.call('DEL', payload_key) end
  out[#out + 1] = pushed
  out[#out + 1] = owned
end
return out
