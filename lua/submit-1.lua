--[[
  Submit requests to one queue, all or none, in one atomic call (docs/protocol.md#producer):
  the standalone and sentinel submit. Per request, in input order: DEL its cancel marker,
  SET its active marker (and, with payload references, its payload key), then INCR its
  deadline's counter, EXPIREAT the counter, and ZADD the member, carrying that count as
  internal.enqueue_seq, at its queue score (deadline + min(seq, 2^21 - 1) / 2^21, written
  '%.17g': lua/_queue-score.lua, docs/protocol.md#enqueue-order).

  Every check comes before the first write: the queue's type, every number, that no
  per-request key is the queue, and every counter (lua/_enqueue.lua); a counter that
  cannot be counted on refuses the whole call.
  The per-request keys are named in ARGV (claimkit/protocol/keys.py builds them): a cancel
  marker is deleted and an active marker or payload key overwritten whatever it holds.

  Input:
    KEYS[1] pending ZSET           <q>

    then twelve per request, repeated:
      counter          request-seq:<q>:<deadline> (STRING, a count)
      counter expiry   Unix seconds (deadline + 3600), EXPIREAT
      cancel key       request-cancel:<id>
      active key       request-active:<id>
      token            the request's request_token (32 hex)
      active expiry    Unix milliseconds (the deadline), SET PXAT
      payload key      request-payload:<id>:<token>, or "" (the payload is in the member)
      payload          the payload's JSON text ("" without a payload key)
      payload expiry   Unix milliseconds (deadline + 10 minutes), SET PXAT ("" without a
                       payload key)
      before           the member's bytes up to its internal.enqueue_seq value
      after            the member's bytes after that value
      deadline         data.deadline, Unix seconds

  Output: { 1, seq_1, ..., seq_n } (each request's internal.enqueue_seq), or
    { 0, i, problem } when request i's counter cannot be counted on: nothing was written.
]]
-- @include _guard-keys
-- @include _checks
-- @include _enqueue

guard_keys('zset')

local STRIDE = 12
if #ARGV % STRIDE ~= 0 then
  error('claimkit: submit takes ' .. STRIDE .. ' arguments per request, got ' .. #ARGV)
end
for i = 1, #ARGV, STRIDE do
  count_arg(i + 1, 1)
  count_arg(i + 5, 1)
  if ARGV[i + 6] ~= '' then count_arg(i + 8, 1) end
  count_arg(i + 11, 1)
  -- A per-request key that is the queue itself would be overwritten before its ZADD.
  for _, j in ipairs({ 0, 2, 3, 6 }) do
    if ARGV[i + j] == KEYS[1] then
      error('claimkit: the queue ' .. KEYS[1] .. ' is also a per-request key of the submit')
    end
  end
end
for i = 1, #ARGV, STRIDE do
  local problem = counter_problem(ARGV[i])
  if problem then return { 0, (i - 1) / STRIDE + 1, ARGV[i] .. ' ' .. problem } end
end

local out = { 1 }
for i = 1, #ARGV, STRIDE do
  redis.call('DEL', ARGV[i + 2])
  redis.call('SET', ARGV[i + 3], ARGV[i + 4], 'PXAT', ARGV[i + 5])
  if ARGV[i + 6] ~= '' then
    redis.call('SET', ARGV[i + 6], ARGV[i + 7], 'PXAT', ARGV[i + 8])
  end
  out[#out + 1] = enqueue(KEYS[1], ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 11]),
    ARGV[i + 9], ARGV[i + 10])
end
return out
