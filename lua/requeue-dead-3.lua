--[[
  Requeue dead letters: move members from the dead set (<q>:dead, docs/protocol.md#keys,
  docs/protocol.md#reclaim) back to pending (claimkit dead requeue).

  Each member goes back by its exact bytes at its queue score (its data.deadline and
  enqueue order, lua/_queue-score.lua), and its delivery count is reset. A member whose JSON cannot be read or that has no positive numeric
  data.deadline stays dead. Unless keep_marker is "1", the request's dedup marker
  (result-terminal:<id>) is deleted when it belongs to this member's generation (holds its
  internal.request_token, or "1" when it has none), so the rerun's terminal record is
  delivered instead of being suppressed as a duplicate (docs/protocol.md#ack).

  Cluster layout (docs/topology.md#cluster-key-layout): the three KEYS are {q}:dead, q and
  {q}:deliveries, one slot; a marker lives in its result list's slot, so the caller passes
  keep_marker "1" (the marker key is never built here) and deletes the markers before with
  lua/drop-markers-2.lua.

  Input:
    KEYS[1] dead ZSET              <q>:dead
    KEYS[2] pending ZSET           <q>
    KEYS[3] deliveries HASH        <q>:deliveries

    ARGV[1] dedup marker prefix    "result-terminal:"
    ARGV[2] keep_marker            "1" keeps the marker, "0" deletes it
    then one per member, repeated: the exact member bytes

  Output: { code_1, ..., code_n } where code is 1 requeued, 0 not in the dead set (any
    more), -1 left dead (no readable data.deadline).
]]
-- @include _guard-keys
-- @include _member
-- @include _queue-score

guard_keys('zset', 'zset', 'hash')

local prefix, keep_marker = ARGV[1], ARGV[2] == '1'
local out = {}

for i = 3, #ARGV do
  local member = ARGV[i]
  local code = 0
  if redis.call('ZSCORE', KEYS[1], member) then
    code = -1
    local doc = decode_member(member)
    local deadline = member_deadline(doc)
    if deadline and deadline > 0 then
      redis.call('ZREM', KEYS[1], member)
      redis.call('ZADD', KEYS[2], member_queue_score(doc), member)
      local id = member_id(doc)
      if id then
        redis.call('HDEL', KEYS[3], id)
        -- A marker key of another type is no marker of this generation (guarded_get).
        local token = member_internal(doc, 'request_token') or '1'
        if not keep_marker and guarded_get(prefix .. id) == token then
          redis.call('DEL', prefix .. id)
        end
      end
      code = 1
    end
  end
  out[#out + 1] = code
end
return out
