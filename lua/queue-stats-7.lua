--[[
  Queue stats: the queue-wide gauges of one queue in one read-only call, one instant of the
  Redis server clock (docs/metrics.md#queue-wide-gauges).

  Nothing is written. Every key is the queue's own (in the cluster layout all seven share the
  pending key's slot); standalone, the retry set and its dead set are the ones every queue
  shares. The work is bounded: O(1) counts, O(log n) range counts, the `sample` lowest-scored
  pending members and the alive consumers (a handful).

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] owners HASH            <q>:claim-owners
    KEYS[3] lease index ZSET       <q>:claims-idx
    KEYS[4] dead ZSET              <q>:dead
    KEYS[5] retry ZSET             the retry set the queue parks into
    KEYS[6] retry dead ZSET        <retry set>:dead
    KEYS[7] consumers ZSET         <q>:consumers (consumer id scored by liveness expiry)

    ARGV[1] sample: how many of the lowest-scored pending members are read for the oldest
            data.created (a whole number >= 1)

  Output: { server_now (string, Unix seconds), pending (ZCARD), claimed (owner entries),
    expired (lease index entries with expiry <= server_now: what a reclaim would take now),
    lowest pending score (string) or nil, oldest data.created among the sampled members
    (string, Unix seconds) or nil, earliest lease expiry (string, Unix seconds) or nil,
    retry set size, retry dead set size, dead set size, consumers alive (score >=
    server_now), the smallest alive consumer id (bytewise) or nil }
]]
-- @flags no-writes
-- @include _server-now
-- @include _checks

local sample = count_arg(1, 1)
local now = server_now()
local now_s = fmt_time(now)

local lowest, oldest = false, nil
local head = redis.call('ZRANGE', KEYS[1], 0, sample - 1, 'WITHSCORES')
for i = 1, #head, 2 do
  if i == 1 then lowest = head[2] end
  local doc = decode_member(head[i])
  local data = doc and doc.data
  local created = type(data) == 'table' and data.created
  if type(created) == 'number' and created == created and (oldest == nil or created < oldest) then
    oldest = created
  end
end

local lease = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')

local exporter = false
local alive = redis.call('ZRANGE', KEYS[7], now_s, '+inf', 'BYSCORE')
for _, id in ipairs(alive) do
  if not exporter or id < exporter then exporter = id end
end

return {
  now_s,
  redis.call('ZCARD', KEYS[1]),
  redis.call('HLEN', KEYS[2]),
  redis.call('ZCOUNT', KEYS[3], '-inf', now_s),
  lowest,
  oldest and string.format('%.17g', oldest) or false,
  lease[2] or false,
  redis.call('ZCARD', KEYS[5]),
  redis.call('ZCARD', KEYS[6]),
  redis.call('ZCARD', KEYS[4]),
  #alive,
  exporter,
}
