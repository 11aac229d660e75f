--[[
  Expire owners (fast failover): cut to server_now the leases of the claims held by
  consumers whose liveness entry lapsed, so the reclaim that follows redelivers them at
  once (docs/protocol.md#fast-failover). A consumer that is alive, however slow its
  requests, is not touched: its heartbeat keeps its entry ahead of the clock.

  A claim's consumer is the part of its ownership token before the last "/"
  (docs/protocol.md#ownership-tokens); a token without one (from before consumer ids, or
  another program's) belongs to no consumer and is left to its lease.

  One cycle walks <q>:claim-owners with HSCAN, one page (COUNT count) per call. The
  cycle's first call (cursor "0", no ids) reads the lapsed consumers: those whose score is
  above 0 and below server_now (a negative score is one already handled); it returns them,
  and the caller passes them to every later call of the cycle, so the cycle acts on one
  set. When a page ends the cycle (HSCAN answers cursor "0"), each of them still lapsed is
  marked handled: its score negated (-expiry), so later cycles skip it and
  `claimkit consumers` still shows it dead, until it is forgotten
  (lua/forget-consumers-2.lua) or it renews again.

  With ARGV[3] = "if-alive" the cycle's first call hands nothing on when no consumer of
  the queue is alive (no entry at or above server_now): every entry lapsed at once is the
  signature of a Redis outage or failover, not of one dead consumer; the claims then wait
  for their leases (docs/protocol.md#fast-failover).

  Input:
    KEYS[1] owners HASH            <q>:claim-owners
    KEYS[2] lease index ZSET       <q>:claims-idx
    KEYS[3] consumer registry ZSET <q>:consumers

    ARGV[1] HSCAN cursor ("0" starts a cycle)
    ARGV[2] count: the HSCAN COUNT (a whole number >= 1)
    ARGV[3] "if-alive" (only while some consumer is alive), "any", or "count": write
            nothing, only count the lapsed consumers (held_back), as a reclaimer that
            skips the failover reports it
    ARGV[4..] the lapsed consumer ids of this cycle; none on its first call

  Leases are cut with ZADD XX LT: a claim without a lease entry is left to the orphan scan
  of lua/reclaim-6.lua, a lease already at or before server_now stays as it is. Every
  check comes before the first write.

  Output: { cut, next_cursor, marked, server_now (string, Unix seconds), held_back, id_1,
    ..., id_n } where cut counts the leases cut, next_cursor is the cursor to pass next
    ("0": the cycle is done), marked counts the consumers marked handled, held_back the
    lapsed consumers left alone ("count", or "if-alive" with no consumer alive; else 0), and
    id_i are the lapsed consumer ids of this cycle (none: nothing lapsed, or held back;
    nothing scanned).
]]
-- @include _server-now
-- @include _guard-keys
-- @include _checks

guard_keys('hash', 'zset', 'zset')
local cursor = ARGV[1]
local count = count_arg(2, 1)
local mode = ARGV[3]
if mode ~= 'if-alive' and mode ~= 'any' and mode ~= 'count' then
  error('claimkit: ARGV[3] must be "if-alive", "any" or "count", got ' .. tostring(mode))
end
local now = server_now()
local ids = {}
if #ARGV > 3 then
  for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
elseif cursor == '0' then
  ids = redis.call('ZRANGE', KEYS[3], '(0', '(' .. fmt_time(now), 'BYSCORE')
  if #ids > 0 and (mode == 'count' or (mode == 'if-alive'
      and redis.call('ZCOUNT', KEYS[3], fmt_time(now), '+inf') == 0)) then
    return { 0, '0', 0, fmt_time(now), #ids }
  end
end
if #ids == 0 then return { 0, '0', 0, fmt_time(now), 0 } end

local lapsed = {}
for _, id in ipairs(ids) do lapsed[id] = true end
local page = redis.call('HSCAN', KEYS[1], cursor, 'COUNT', count)
local fields = page[2]
local cut_to = fmt_time(now)
local leases = {}
for j = 1, #fields, 2 do
  local consumer = string.match(fields[j + 1], '^(.*)/[^/]*$')
  if consumer and lapsed[consumer] then
    leases[#leases + 1] = cut_to
    leases[#leases + 1] = fields[j]
  end
end

local cut = 0
local STEP = 2000 -- values per ZADD: far below Lua's unpack() limit (8000)
for first = 1, #leases, STEP do
  local last = math.min(#leases, first + STEP - 1)
  cut = cut + redis.call('ZADD', KEYS[2], 'XX', 'LT', 'CH', unpack(leases, first, last))
end

local marked = 0
if page[1] == '0' then
  for _, id in ipairs(ids) do
    local score = tonumber(redis.call('ZSCORE', KEYS[3], id))
    if score and score > 0 and score < now then
      redis.call('ZADD', KEYS[3], 'XX', string.format('%.6f', -score), id)
      marked = marked + 1
    end
  end
end
local out = { cut, page[1], marked, fmt_time(now), 0 }
for _, id in ipairs(ids) do out[#out + 1] = id end
return out
