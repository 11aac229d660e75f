--[[
  Durable result delivery, receive: claim the oldest records of a result list under a
  lease (docs/results.md#receive). Wire-compatible with llm-d-async's result readers: every
  entry written is the one theirs would write.

  Input:
    KEYS[1] result LIST (LPUSHed; the oldest is the right end)   L
    KEYS[2] claimed HASH: claim id -> exact record bytes          L:result-claimed
    KEYS[3] owners HASH: claim id -> owner token                  L:result-claim-owners
    KEYS[4] lease index ZSET: claim id by lease expiry            L:result-claims-idx
    KEYS[5] tombstones ZSET: claim id by tombstone expiry         L:result-ack-tombstones
    (cluster layout: {L}:result-claimed etc., all in L's slot)

    ARGV[1] owner token (non-empty): written to owners for every record this call claims
    ARGV[2] lease, milliseconds (whole, >= 1)
    ARGV[3] reclaim batch: at most this many expired leases requeued per call (>= 1)
    ARGV[4] scan batch: at most min(LLEN, this) list elements looked at per call (>= 1)
    ARGV[5] tombstone cleanup batch: at most this many expired tombstones removed (>= 1)
    ARGV[6] optional, count: claim up to this many records (default 1, >= 1). With 1 the
            call is llm-d-async's receive exactly.

  Steps (times are server-clock milliseconds, lua/_result-clock.lua):
    1. Up to ARGV[3] claims whose lease expired (score <= now), oldest first, are walked in
       reverse: each one's bytes still in claimed are RPUSHed back onto L (so the oldest
       expired is read next) and its claimed, owners and index entries are deleted.
    2. Up to ARGV[5] expired tombstones are removed.
    3. From the right end of L: decode the record; its claim id is data.id, plus NUL and
       request_token when that is a non-empty string. A record that is not a JSON object
       with a non-empty string id, or whose request_token is present but not a string, is
       claimed under "\0unparsable-result\0" .. owner and the scan stops (one unparsable
       record per call: a second would reuse the claim id). A record whose claim id has a
       live tombstone (acked) or a live owner (leased) is a duplicate and is RPOPed; an
       expired tombstone is removed and counts as none. Anything else is RPOPed and
       claimed: claimed[cid] = bytes, owners[cid] = owner, index[cid] = now + lease.

  Output:
    { code_1, bytes_1, claim_id_1, code_2, ... }: one triple per record claimed, oldest
      first; code 1 a record, -1 an unparsable record (still leased, report it);
    { 0 }: nothing claimed, but the scan dropped duplicates and L is not empty: call again;
    { }: nothing to claim.
]]
-- @include _guard-keys
-- @include _checks
-- @include _result-clock

guard_keys('list', 'hash', 'hash', 'zset', 'zset')

local owner = owner_arg(1)
local lease = count_arg(2, 1)
local reclaim_batch = count_arg(3, 1)
local scan_batch = count_arg(4, 1)
local cleanup_batch = count_arg(5, 1)
local want = 1
if ARGV[6] ~= nil then want = count_arg(6, 1) end

local now = server_now_ms()

-- 1. Expired leases back to the read end, the oldest expired last pushed (read first).
local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ms_arg(now), 'LIMIT', 0,
  reclaim_batch)
for i = #expired, 1, -1 do
  local cid = expired[i]
  local raw = redis.call('HGET', KEYS[2], cid)
  if raw then redis.call('RPUSH', KEYS[1], raw) end
  redis.call('HDEL', KEYS[2], cid)
  redis.call('HDEL', KEYS[3], cid)
  redis.call('ZREM', KEYS[4], cid)
end

-- 2. Bounded tombstone cleanup.
drop_expired(KEYS[5], now, cleanup_batch)

-- 3. Scan from the read end.
local function claim_id(raw)
  local ok, doc = pcall(cjson.decode, raw)
  if not ok or type(doc) ~= 'table' then return nil end
  local id, token = doc['id'], doc['request_token']
  if type(id) ~= 'string' or id == '' then return nil end
  if token ~= nil and type(token) ~= 'string' then return nil end
  if token ~= nil and token ~= '' then return id .. '\0' .. token end
  return id
end

local function claim(raw, cid)
  redis.call('RPOP', KEYS[1])
  redis.call('HSET', KEYS[2], cid, raw)
  redis.call('HSET', KEYS[3], cid, owner)
  redis.call('ZADD', KEYS[4], ms_arg(now + lease), cid)
end

local out = {}
local got = 0
local dropped = 0
local budget = math.min(redis.call('LLEN', KEYS[1]), scan_batch)
for _ = 1, budget do
  if got >= want then break end
  local raw = redis.call('LINDEX', KEYS[1], -1)
  if not raw then break end
  local cid = claim_id(raw)
  if cid == nil then
    cid = '\0unparsable-result\0' .. owner
    claim(raw, cid)
    out[#out + 1] = -1
    out[#out + 1] = raw
    out[#out + 1] = cid
    got = got + 1
    break
  end
  local live = false
  local tomb = redis.call('ZSCORE', KEYS[5], cid)
  if tomb then
    if tonumber(tomb) > now then
      live = true
    else
      redis.call('ZREM', KEYS[5], cid)
    end
  end
  if live or redis.call('HEXISTS', KEYS[3], cid) == 1 then
    redis.call('RPOP', KEYS[1]) -- a duplicate of an acked or a leased generation
    dropped = dropped + 1
  else
    claim(raw, cid)
    out[#out + 1] = 1
    out[#out + 1] = raw
    out[#out + 1] = cid
    got = got + 1
  end
end

if got == 0 and dropped > 0 and redis.call('LLEN', KEYS[1]) > 0 then return { 0 } end
return out
