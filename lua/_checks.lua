-- Include: checks that fail a script before its first write (a script that fails keeps every
-- write it made before the failure: Redis has no rollback).
--
-- count_arg(i, lo): ARGV[i] as a whole number >= lo, or fail. Used for limits, counts and
-- TTLs that later reach a command (SET ... EX) or a comparison that would fail mid-script.
-- number_arg(i): ARGV[i] as a number that is not NaN, or fail (seconds: a lease, a delay,
-- a deadline).
-- list_usable(key, what): fail unless key holds a list or does not exist (a fallback result
-- list that a LPUSH meets half-way would fail the script after its earlier writes).
-- claim_score(member, raw): the pending score to put a claimed member back at: its
-- <id>:score field when that is a number, else the member's own queue score (its deadline
-- and enqueue order, lua/_queue-score.lua), else 0 when its data.deadline cannot be read
-- (the peek then dead-letters it as malformed). Never nil: a payload is never dropped.
-- next_delivery(key, id): HINCRBY key id 1 that cannot fail: a field that is not a whole
-- number (a hand edit) counts as 0.
-- @include _member
-- @include _queue-score

local function count_arg(i, lo)
  local n = tonumber(ARGV[i])
  if not n or n ~= math.floor(n) or n < lo or n > 9007199254740991 then
    error('claimkit: ARGV[' .. i .. '] must be a whole number >= ' .. lo .. ', got '
      .. tostring(ARGV[i]))
  end
  return n
end

local function number_arg(i)
  local n = tonumber(ARGV[i])
  if not n or n ~= n then
    error('claimkit: ARGV[' .. i .. '] must be a number, got ' .. tostring(ARGV[i]))
  end
  return n
end

local function list_usable(key, what)
  -- A key of another type fails here with Redis's own WRONGTYPE error, as guard_keys does
  -- (the consumer recognises it and checks its keys' types).
  redis.call('LLEN', key)
  for _, k in ipairs(KEYS) do
    if k == key then error('claimkit: ' .. what .. ' ' .. key .. ' is one of the queue keys') end
  end
end

local function claim_score(member, raw)
  local s = tonumber(raw)
  if s and s == s then return string.format('%.17g', s) end
  return member_queue_score(decode_member(member)) or '0'
end

local function next_delivery(key, id)
  local n = tonumber(redis.call('HGET', key, id))
  if not n or n ~= math.floor(n) or n < 0 or n >= 9007199254740991 then n = 0 end
  n = n + 1
  redis.call('HSET', key, id, string.format('%d', n))
  return n
end
