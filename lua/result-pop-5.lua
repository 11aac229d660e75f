--[[
  Destructive read of a result list (``claimkit results --pop``, ``Producer.results(pop=True)``),
  refused while the list has durable readers (docs/results.md#never-mix-popping-and-durable-readers):
  a pop would take records a durable reader counts on, and a durable reader's requeued
  record would be popped without an ack.

  Input:
    KEYS[1] result LIST          L
    KEYS[2] claimed HASH         L:result-claimed
    ({L}:... in the cluster layout)
    KEYS[3] owners HASH          L:result-claim-owners
    KEYS[4] lease index ZSET     L:result-claims-idx
    KEYS[5] tombstones ZSET      L:result-ack-tombstones

    ARGV[1] count: at most this many records (whole, >= 1)

  Output: { 0 } refused (one of KEYS[2..5] exists; nothing popped), or { 1, record, ... }:
    the records popped, oldest first (RPOP count).
]]
-- @include _guard-keys
-- @include _checks

guard_keys('list', 'hash', 'hash', 'zset', 'zset')
local count = count_arg(1, 1)
if redis.call('EXISTS', KEYS[2], KEYS[3], KEYS[4], KEYS[5]) > 0 then return { 0 } end
local out = { 1 }
local popped = redis.call('RPOP', KEYS[1], count)
if popped then
  for i = 1, #popped do out[#out + 1] = popped[i] end
end
return out
