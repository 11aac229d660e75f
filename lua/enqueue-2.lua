--[[
  Add submitted requests of one deadline to their queue in a Redis Cluster, in one atomic
  call (docs/topology.md#retries-cancellation-and-the-producer): the cluster submit's last
  step, after its cancel markers were deleted and its active markers (and payload keys)
  set. Per request, in input order: INCR the deadline's counter, EXPIREAT it, and ZADD the
  member, carrying that count as internal.enqueue_seq, at its queue score (deadline +
  min(seq, 2^21 - 1) / 2^21, written '%.17g': lua/_queue-score.lua,
  docs/protocol.md#enqueue-order). Both keys share the queue's slot.

  Every check comes before the first write: the queue's type, the numbers, the counter
  (another key than the queue).

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] counter STRING         request-seq:{q}:<deadline>

    ARGV[1] counter expiry: Unix seconds (deadline + 3600), EXPIREAT
    ARGV[2] deadline: data.deadline of every request here, Unix seconds
    then two per request, repeated:
      before           the member's bytes up to its internal.enqueue_seq value
      after            the member's bytes after that value

  Output: { 1, seq_1, ..., seq_n } (each request's internal.enqueue_seq), or
    { 0, 1, problem } when the counter cannot be counted on: nothing was written.
]]
-- @include _guard-keys
-- @include _checks
-- @include _enqueue

guard_keys('zset')
count_arg(1, 1)
local deadline = count_arg(2, 1)
if #ARGV % 2 ~= 0 then
  error('claimkit: enqueue takes two arguments per request after the first two, got '
    .. (#ARGV - 2))
end
if KEYS[2] == KEYS[1] then error('claimkit: the counter is the queue ' .. KEYS[1]) end
local problem = counter_problem(KEYS[2])
if problem then return { 0, 1, KEYS[2] .. ' ' .. problem } end

local out = { 1 }
for i = 3, #ARGV, 2 do
  out[#out + 1] = enqueue(KEYS[1], KEYS[2], ARGV[1], deadline, ARGV[i], ARGV[i + 1])
end
return out
