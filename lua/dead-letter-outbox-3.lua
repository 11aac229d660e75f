--[[
  Dead-letter malformed pending members in a Redis Cluster (docs/protocol.md#peek,
  docs/topology.md#acks-across-slots): as lua/dead-letter-2.lua, but the INVALID_REQUEST
  record of a member whose id could be read goes into the queue's outbox (its list and its
  dedup markers may live in another slot); the caller pushes it with lua/push-result-3.lua
  and deletes the entry, and any reclaimer replays an entry left behind. Nothing is ever
  silently dropped.

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] dead ZSET              {q}:dead
    KEYS[3] outbox HASH            {q}:outbox

    then six per member, repeated:
      member (exact bytes), request_token (internal.request_token, "" when unreadable),
      id ("" = no record: none could be read), outbox field (<id>\0<fresh token>),
      result_list, record (JSON)

  Output: { moved_1, queued_1, ..., moved_n, queued_n }: moved is 1 when this call moved
    the member (0: another consumer already did); queued is 1 when its record went into the
    outbox.
]]
-- @include _server-now
-- @include _guard-keys
-- @include _outbox

guard_keys('zset', 'zset', 'hash')

local now = server_now()
local out = {}

for i = 1, #ARGV, 6 do
  local member, id = ARGV[i], ARGV[i + 2]
  local moved, queued = 0, 0
  if redis.call('ZREM', KEYS[1], member) == 1 then
    redis.call('ZADD', KEYS[2], now, member)
    moved = 1
    if id ~= '' then
      outbox_put(KEYS[3], ARGV[i + 3], ARGV[i + 4], ARGV[i + 1], ARGV[i + 5], id)
      queued = 1
    end
  end
  out[#out + 1] = moved
  out[#out + 1] = queued
end
return out
