-- Include: counting submitted requests and adding them to their queue in submission order
-- (docs/protocol.md#enqueue-order), the one copy: lua/submit-1.lua (standalone) and
-- lua/enqueue-2.lua (cluster) run it.
--
-- counter_problem(key): nil when `key`, a request-seq:<q>:<deadline> counter, can be
--   counted on (missing, or a string holding a whole number from 0 to 999999999999999, as
--   only INCR writes it), else what is wrong with it ('holds a hash, not a count'), for the
--   caller's one-line error. A
--   read that cannot fail; done for every counter before the first write (an INCR meeting
--   another type or a non-number after earlier writes would fail the script half-way).
-- enqueue(queue, counter, expire_at, deadline, before, after): INCR counter, EXPIREAT it
--   at expire_at (Unix seconds), and ZADD the member `before .. seq .. after` to queue at
--   format_score(queue_score(deadline, seq)); returns seq, the member's
--   internal.enqueue_seq. Cannot fail once counter_problem(counter) was nil.
-- @include _queue-score

local function counter_problem(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then return nil end
  if kind ~= 'string' then return 'holds a ' .. kind .. ', not a count' end
  local value = redis.call('GET', key)
  if #value <= 15 and (value == '0' or string.match(value, '^[1-9]%d*$')) then return nil end
  return 'holds a string that is not a count'
end

local function enqueue(queue, counter, expire_at, deadline, before, after)
  local seq = redis.call('INCR', counter)
  redis.call('EXPIREAT', counter, expire_at)
  -- %d, not tostring or .., which would write 1e+15 past 14 digits.
  local member = before .. string.format('%d', seq) .. after
  redis.call('ZADD', queue, format_score(queue_score(deadline, seq, nil)), member)
  return seq
end
