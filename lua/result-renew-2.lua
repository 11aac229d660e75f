--[[
  Durable result delivery, renew: extend one held record's lease, fenced by its owner
  token (docs/results.md#renew). llm-d-async's renew exactly; a reader renews all it holds
  in one round trip by pipelining one call per record.

  Input:
    KEYS[1] owners HASH          L:result-claim-owners
    KEYS[2] lease index ZSET     L:result-claims-idx
    ({L}:... in the cluster layout)

    ARGV[1] claim id
    ARGV[2] owner token (non-empty)
    ARGV[3] lease, milliseconds (whole, >= 1)

  Output: 1 renewed (the lease becomes server now + ARGV[3] ms; it may shorten), 0 ownership
    lost: another owner holds it, or it was acked, or its lease already expired (an expired
    lease is never revived: a receive may already have put the record back).
]]
-- @include _guard-keys
-- @include _checks
-- @include _result-clock

guard_keys('hash', 'zset')

local cid = ARGV[1]
local owner = owner_arg(2)
local lease = count_arg(3, 1)
local now = server_now_ms()

if redis.call('HGET', KEYS[1], cid) ~= owner then return 0 end
local expiry = redis.call('ZSCORE', KEYS[2], cid)
if not expiry or tonumber(expiry) <= now then return 0 end
redis.call('ZADD', KEYS[2], ms_arg(now + lease), cid)
return 1
