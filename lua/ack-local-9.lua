--[[
  Ack in a Redis Cluster when the result list shares the queue's slot: push each record
  once and drop its claim, in one step, as lua/ack-5.lua does in standalone
  (docs/topology.md#one-script-acks-tag-the-queue-and-its-list-together).

  The live-copy rule is ack-5's: a record is pushed only together with the removal of
  the request's one live copy (the caller's own claim, or else the exact member still
  pending); otherwise it is suppressed. The dedup markers are the list's own
  (lua/_markers.lua), declared here. When the list (or a marker key) holds another type, or
  is one of this script's queue keys, the record cannot go there: it is moved into the
  outbox instead, aimed at the fallback list (which may live in another slot), and the
  caller finishes it as an ack across slots does (docs/topology.md#acks-across-slots).
  When the list is itself the fallback (ARGV[2] = "1") a list of another type fails the
  call with WRONGTYPE before any write, as ack-5 does.

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] claimed HASH           {q}:claimed
    KEYS[3] owners HASH            {q}:claim-owners
    KEYS[4] lease index ZSET       {q}:claims-idx
    KEYS[5] deliveries HASH        {q}:deliveries
    KEYS[6] outbox HASH            {q}:outbox
    KEYS[7] result LIST            L (in the queue's slot)
    KEYS[8] marker HASH            {L}:result-terminal
    KEYS[9] marker expiry ZSET     {L}:result-terminal-expiry

    ARGV[1] dedup ttl, whole seconds (0 = markers never expire)
    ARGV[2] "1" when L is the fallback list itself, else "0"
    ARGV[3] the fallback list's name (an outbox entry's destination; not read here)
    then six per request, repeated:
      id, token (ownership token), request_token (internal.request_token or ""),
      record (JSON), member (the exact claimed bytes), outbox field (<id>\0<token>)

  Output: { pushed_1, owned_1, moved_1, ..., pushed_n, owned_n, moved_n } where pushed is
    1 (record pushed) or 0 (suppressed, or moved), owned is 1 (the claim was the caller's
    and is deleted) or 0, and moved is 1 when the record went into the outbox for the
    fallback list (also when an earlier call already put it there) instead of being pushed.
]]
-- @include _server-now
-- @include _live-copy
-- @include _outbox
-- @include _guard-keys
-- @include _checks
-- @include _markers

guard_keys('zset', 'hash', 'hash', 'zset', 'hash', 'hash')

local dedup_ttl, final, fallback = count_arg(1, 0), ARGV[2] == '1', ARGV[3]
local kind = redis.call('TYPE', KEYS[7])['ok']
local usable = (kind == 'list' or kind == 'none') and markers_usable(KEYS[8], KEYS[9])
for k = 1, 6 do
  if KEYS[k] == KEYS[7] or KEYS[k] == KEYS[8] or KEYS[k] == KEYS[9] then usable = false end
end
if final and not usable then
  -- Redis's own WRONGTYPE (or claimkit's "one of the queue keys") before any write.
  redis.call('LLEN', KEYS[7])
  redis.call('HLEN', KEYS[8])
  redis.call('ZCARD', KEYS[9])
  list_usable(KEYS[7], 'the fallback result list')
  error('claimkit: the fallback result list ' .. KEYS[7] .. ' shares a name with a queue key')
end

local now = server_now()
if usable then sweep_markers(KEYS[8], KEYS[9], now) end
local out = {}

for i = 4, #ARGV, 6 do
  local id, token, request_token = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local record, member, field = ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
  local pushed, owned, moved = 0, 0, 0
  if redis.call('HEXISTS', KEYS[6], field) == 1 then
    moved = 1
  else
    local live = take_live_copy(id, token, member)
    if live == 1 then owned = 1 end
    if live ~= 0 and usable then
      pushed = push_marked(KEYS[7], KEYS[8], KEYS[9], id, record, request_token, dedup_ttl, now)
    elseif live ~= 0 then
      outbox_put(KEYS[6], field, fallback, request_token, record, id)
      moved = 1
    end
  end
  out[#out + 1] = pushed
  out[#out + 1] = owned
  out[#out + 1] = moved
end
return out
