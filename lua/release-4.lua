--[[
  Release / sweep: hand claims back to pending at their original score, fenced
  (docs/protocol.md#release-and-sweep).

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] claimed HASH           <q>:claimed
    KEYS[3] owners HASH            <q>:claim-owners
    KEYS[4] lease index ZSET       <q>:claims-idx

    then three per claim, repeated:
      id, token (ownership token),
      expected lease expiry (Unix seconds) or "" (drain passes the expiry it read, so a
      claim renewed since is left alone)

  Output: { code_1, ..., code_n } where code is 1 released (the exact claimed bytes are
    back in pending at the <id>:score field's score; at the member's own queue score, its
    data.deadline and enqueue order (lua/_queue-score.lua), when that field is missing or
    not a number), 0 gone, -1 owned by another token, -2 renewed since it was read.
]]
-- @include _drop-claim
-- @include _guard-keys
-- @include _checks

guard_keys('zset', 'hash', 'hash', 'zset')

local out = {}

for i = 1, #ARGV, 3 do
  local id, token, expected = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local owner = redis.call('HGET', KEYS[3], id)
  local code = 0
  if owner and owner ~= token then
    code = -1
  elseif owner and expected ~= '' and tonumber(redis.call('ZSCORE', KEYS[4], id)) ~= tonumber(expected) then
    code = -2
  elseif owner then
    local member = redis.call('HGET', KEYS[2], id)
    if member then
      -- A missing or broken <id>:score field must not drop the payload nor fail the ZADD
      -- after earlier releases: claim_score falls back to the member's queue score.
      local score = claim_score(member, redis.call('HGET', KEYS[2], id .. ':score'))
      redis.call('ZADD', KEYS[1], score, member)
    end
    drop_claim(KEYS[2], KEYS[3], KEYS[4], id)
    code = 1
  end
  out[#out + 1] = code
end
return out
