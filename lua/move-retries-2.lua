--[[
  Retry mover: move due retry members back to their queue at their queue score (deadline
  and enqueue order, lua/_queue-score.lua; docs/protocol.md#retry-mover).

  A member whose JSON cannot be read, that lacks internal.request_queue_name or a numeric
  data.deadline, or whose queue key holds another type, cannot be routed: it goes to the
  retry dead set, never dropped.

  Input:
    KEYS[1] retry ZSET             retry-sortedset
    KEYS[2] retry dead ZSET        retry-sortedset:dead

    ARGV[1] limit: at most this many members per call

  Output: { moved, dead, more } where more is 1 when the limit was reached (call again).
]]
-- @include _guard-keys
-- @include _checks
-- @include _move-retries

guard_keys('zset', 'zset')

local limit = count_arg(1, 1)
return move_due_retries(limit, function(doc)
  local queue = member_internal(doc, 'request_queue_name')
  if queue == nil then return nil end
  -- A destination of another type would fail the ZADD after the ZREM: the script is not
  -- rolled back, so the member would be lost. Dead-letter it instead.
  local kind = redis.call('TYPE', queue)['ok']
  if kind == 'zset' or kind == 'none' then return queue end
  return nil
end)
