--[[
  Retry mover: move due retry members back to their queue at score = deadline
  (docs/protocol.md#retry-mover).

  A member whose JSON cannot be read, that lacks internal.request_queue_name or a numeric
  data.deadline, or whose queue key holds another type, cannot be routed: it goes to the
  retry dead set, never dropped.

  Input:
    KEYS[1] retry ZSET             retry-sortedset
    KEYS[2] retry dead ZSET        retry-sortedset:dead

    ARGV[1] limit: at most this many members per call

  Output: { moved, dead, more } where more is 1 when the limit was reached (call again).
]]
-- @include _server-now
-- @include _guard-keys
-- @include _checks
-- @include _member

guard_keys('zset', 'zset')

local limit = count_arg(1, 1)
local now = server_now()
local due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, limit)
local moved, dead = 0, 0

for _, member in ipairs(due) do
  local doc = decode_member(member)
  local queue, deadline = member_internal(doc, 'request_queue_name'), member_deadline(doc)
  redis.call('ZREM', KEYS[1], member)
  local routable = queue ~= nil and deadline ~= nil
  if routable then
    -- A destination of another type would fail the ZADD after the ZREM: the script is not
    -- rolled back, so the member would be lost. Dead-letter it instead.
    local kind = redis.call('TYPE', queue)['ok']
    routable = kind == 'zset' or kind == 'none'
  end
  if routable then
    redis.call('ZADD', queue, deadline, member)
    moved = moved + 1
  else
    redis.call('ZADD', KEYS[2], now, member)
    dead = dead + 1
  end
end
local more = 0
if #due == limit then more = 1 end
return { moved, dead, more }
