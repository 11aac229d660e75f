--[[
  Durable result delivery, ack: finish one held record, fenced by its owner token, and
  leave a tombstone that drops later duplicates of it (docs/results.md#ack).
  llm-d-async's ack exactly.

  Input:
    KEYS[1] claimed HASH         L:result-claimed
    KEYS[2] owners HASH          L:result-claim-owners
    KEYS[3] lease index ZSET     L:result-claims-idx
    KEYS[4] tombstones ZSET      L:result-ack-tombstones
    ({L}:... in the cluster layout)

    ARGV[1] claim id
    ARGV[2] owner token (non-empty)
    ARGV[3] tombstone ttl, milliseconds (whole, >= 1; 604800000 = 7 days)
    ARGV[4] tombstone cleanup batch (>= 1): expired tombstones removed first

  Output:
    1 acked: the claim's three entries deleted, tombstone[cid] = now + ttl, and the
      tombstone set's PEXPIRE set to ttl;
    2 already acked: a live tombstone exists (a repeated ack is fine);
    0 ownership lost: another owner holds it or its lease expired (it will be, or was,
      delivered again).
]]
-- @include _guard-keys
-- @include _checks
-- @include _result-clock

guard_keys('hash', 'hash', 'zset', 'zset')

local cid = ARGV[1]
local owner = owner_arg(2)
local ttl = count_arg(3, 1)
local cleanup_batch = count_arg(4, 1)
local now = server_now_ms()

drop_expired(KEYS[4], now, cleanup_batch)

if redis.call('HGET', KEYS[2], cid) == owner then
  local expiry = redis.call('ZSCORE', KEYS[3], cid)
  if expiry and tonumber(expiry) > now then
    redis.call('HDEL', KEYS[1], cid)
    redis.call('HDEL', KEYS[2], cid)
    redis.call('ZREM', KEYS[3], cid)
    redis.call('ZADD', KEYS[4], ms_arg(now + ttl), cid)
    redis.call('PEXPIRE', KEYS[4], ttl)
    return 1
  end
end
local tomb = redis.call('ZSCORE', KEYS[4], cid)
if tomb then
  if tonumber(tomb) > now then return 2 end
  redis.call('ZREM', KEYS[4], cid)
end
return 0
