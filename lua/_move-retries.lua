-- Include: the retry mover's loop (docs/protocol.md#retry-mover), the one copy:
-- lua/move-retries-2.lua (the shared retry set, standalone) and
-- lua/move-retries-queue-3.lua (one queue's retry set, cluster) both run it.
--
-- move_due_retries(limit, route): move up to `limit` due members of KEYS[1] back to the
-- queue route(doc) names, at the member's queue score (its data.deadline and enqueue
-- order, lua/_queue-score.lua: where it stood before it was claimed); a member route gives
-- no queue for (nil), or whose JSON or data.deadline cannot be read, goes to KEYS[2] (the
-- retry dead set), never dropped. route(doc) must not fail and must name only a key that holds a
-- sorted set or does not exist (a ZADD meeting another type after the ZREM would lose the
-- member: Redis does not roll a script back). Returns { moved, dead, more } where more
-- is 1 when the limit was reached (call again).
-- @include _server-now
-- @include _member
-- @include _queue-score

local function move_due_retries(limit, route)
  local now = server_now()
  local due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, limit)
  local moved, dead = 0, 0

  for _, member in ipairs(due) do
    local doc = decode_member(member)
    local score = member_queue_score(doc)
    redis.call('ZREM', KEYS[1], member)
    local queue = score ~= nil and route(doc) or nil
    if queue then
      redis.call('ZADD', queue, score, member)
      moved = moved + 1
    else
      redis.call('ZADD', KEYS[2], now, member)
      dead = dead + 1
    end
  end
  local more = 0
  if #due == limit then more = 1 end
  return { moved, dead, more }
end
