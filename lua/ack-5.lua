--[[
  Ack: push each terminal record once and drop its claim, in one step (SPEC §3.4).

  The record is pushed under the generation-aware dedup marker whether or not the caller
  still owns the claim (the work is done; losing its record is the one thing not allowed).
  The claim is deleted only when the caller's token still owns it. When the caller no
  longer owns it and the same member was redelivered to pending meanwhile, that copy is
  withdrawn: its generation already has its record.

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] claimed HASH           <q>:claimed
    KEYS[3] owners HASH            <q>:claim-owners
    KEYS[4] lease index ZSET       <q>:claims-idx
    KEYS[5] deliveries HASH        <q>:deliveries

    ARGV[1] dedup ttl, whole seconds (0 = markers never expire)
    then seven per request, repeated:
      id, token (ownership token), gen_token (internal.request_token or ""),
      marker_key (result-terminal:<id>), result_key (result list), record (JSON),
      member (the exact claimed bytes)

  Output: { pushed_1, owned_1, ..., pushed_n, owned_n } where pushed is 1 (record pushed)
    or 0 (suppressed duplicate) and owned is 1 (claim deleted) or 0 (not ours any more).
]]
-- @include _push-terminal
-- @include _drop-claim

local dedup_ttl = tonumber(ARGV[1])
local out = {}

for i = 2, #ARGV, 7 do
  local id, token, gen_token = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local pushed = push_terminal(ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], gen_token, dedup_ttl)
  local owned = 0
  if redis.call('HGET', KEYS[3], id) == token then
    drop_claim(KEYS[2], KEYS[3], KEYS[4], id)
    redis.call('HDEL', KEYS[5], id)
    owned = 1
  elseif redis.call('ZREM', KEYS[1], ARGV[i + 6]) == 1 then
    redis.call('HDEL', KEYS[5], id)
  end
  out[#out + 1] = pushed
  out[#out + 1] = owned
end
return out
