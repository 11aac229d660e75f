-- Include: the retry mover's loop (docs/protocol.md#retry-mover), the one copy:
-- lua/move-retries-2.lua (the shared retry set, standalone) and
-- lua/move-retries-queue-3.lua (one queue's retry set, cluster) both run it.
--
-- move_due_retries(limit, route): move up to `limit` due members of KEYS[1] back to the
-- queue route(doc) names, at score = data.deadline; a member route gives no queue for
-- (nil), or whose JSON or data.deadline cannot be read, goes to KEYS[2] (the retry dead
-- set), never dropped. route(doc) must not fail and must name only a key that holds a
-- sorted set or does not exist (a ZADD meeting another type after the ZREM would lose the
-- member: Redis does not roll a script back). Returns { moved, dead, more } where more
-- is 1 when the limit was reached (call again).
-- @include _server-now
-- @include _member

local function move_due_retries(limit, route)
  local now = server_now()
  local due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, limit)
  local moved, dead = 0, 0

  for _, member in ipairs(due) do
    local doc = decode_member(member)
    local deadline = member_deadline(doc)
    redis.call('ZREM', KEYS[1], member)
    local queue = deadline ~= nil and doc ~= nil and route(doc) or nil
    if queue then
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
end
