--[[
  Retry mover of one queue in a Redis Cluster: move due members of the queue's own retry set
  back to the queue at their queue score (deadline and enqueue order,
  lua/_queue-score.lua; docs/protocol.md#retry-mover,
  docs/topology.md#retries-cancellation-and-the-producer). All three keys share the queue's
  slot.

  Park writes only this queue's members here (internal.request_queue_name = the queue). A
  member whose JSON cannot be read, that lacks a numeric data.deadline, or whose
  internal.request_queue_name names another queue (written by hand: it cannot be moved to
  a key of another slot from here) goes to the retry dead set, never dropped. A queue key
  of another type fails the call before any write (WRONGTYPE): the members stay in the
  retry set.

  Input:
    KEYS[1] retry ZSET             {q}:retry-sortedset
    KEYS[2] retry dead ZSET        {q}:retry-sortedset:dead
    KEYS[3] pending ZSET           <q>

    ARGV[1] limit: at most this many members per call

  Output: { moved, dead, more } where more is 1 when the limit was reached (call again).
]]
-- @include _guard-keys
-- @include _checks
-- @include _move-retries

guard_keys('zset', 'zset', 'zset')

local limit = count_arg(1, 1)
return move_due_retries(limit, function(doc)
  if member_internal(doc, 'request_queue_name') == KEYS[3] then return KEYS[3] end
  return nil
end)
