--[[
  Reclaim: redeliver claims whose lease expired by server time (docs/protocol.md#reclaim).

  Takes up to `limit` expired claims. Each goes back to pending at its original score with
  its delivery count incremented; one whose count reaches max_deliveries goes to the dead
  set instead and gets a MAX_DELIVERIES_EXCEEDED record (once per generation; its JSON from
  lua/_record.lua, the bytes TerminalRecord.to_json would write). Index
  entries with no claimed payload (ghosts) are removed.

  Claims without a lease entry (orphans: the index entry was evicted, lost in a partial
  restore or deleted by hand) are given their lease back, not redelivered: their owner may
  be alive with the request in flight (docs/protocol.md, "Claims without a lease entry").
  An orphan with a payload (whether or not it has an owner entry) gets
  claims-idx[id] = the lease a claim taken now would get (lua/_lease.lua, the claim rule:
  min(now + ARGV[10], data.deadline + 30), never less than now + min(ARGV[10], 30)); its
  live owner renews it as usual, a dead owner's claim expires one lease later and goes the
  expired way above (its delivery counted, max_deliveries honoured). An orphan with no
  payload (an owner entry or a stray <id>:score field alone) is a ghost and is removed.
  Orphans are found by a bounded scan: each call
  reads one HSCAN page (COUNT scan_count) of <q>:claimed or <q>:claim-owners, as the caller
  asks, and handles at most scan_count orphans; when the page holds more, the cursor is not
  advanced, so the next call reads the same page again (the handled ones are gone by then).
  A payload whose <id>:score field is missing or not a number goes back at its
  data.deadline (0 when that cannot be read either: the peek then dead-letters it as
  malformed); a payload is never dropped. Every read, and every check that could fail, comes
  before the first write (docs/protocol.md, "Scripts never fail half-way").

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] claimed HASH           <q>:claimed
    KEYS[3] owners HASH            <q>:claim-owners
    KEYS[4] lease index ZSET       <q>:claims-idx
    KEYS[5] deliveries HASH        <q>:deliveries
    KEYS[6] dead ZSET              <q>:dead

    ARGV[1] limit: at most this many expired claims per call
    ARGV[2] max_deliveries (0 = unlimited)
    ARGV[3] the queue's configured result list, or "" (then the member's
            internal.result_queue_name, then ARGV[4]): the routing rule of
            claimkit.protocol.routing.ResultRouting, which sends both (lua_args)
    ARGV[4] the global result list (also where a record goes when its own list holds
            another type)
    ARGV[5] dedup marker prefix "result-terminal:"
    ARGV[6] dedup ttl, whole seconds (0 = no expiry)
    ARGV[7] orphan scan: 2 scans KEYS[2] (<q>:claimed), 3 scans KEYS[3] (<q>:claim-owners),
            0 or absent: no scan
    ARGV[8] the HSCAN cursor to read from ("0" starts a cycle)
    ARGV[9] scan_count: the HSCAN COUNT, and at most this many orphans per call
    ARGV[10] lease ttl, seconds (a number > 0: the consumers' claim_lease_ttl_seconds),
            the lease an orphan is given back; read only when ARGV[7] is 2 or 3

  Output: { redelivered, dead, ghosts, more, orphans, cursor, capped, leases_restored }
    where redelivered and dead count expired claims, ghosts the entries removed for want
    of a payload (index entries, and orphans with no payload), more is 1 when the limit
    was reached or the scan page held more orphans than scan_count (call again), orphans
    counts the claims without a lease entry handled (each is counted in leases_restored or
    ghosts), cursor is the one to pass next, capped is 1 when that is the same page again
    ("0" and capped 0: this hash's scan cycle is done), and leases_restored counts the
    orphans given their lease entry back.
]]
-- @include _server-now
-- @include _push-terminal
-- @include _drop-claim
-- @include _guard-keys
-- @include _checks
-- @include _lease
-- @include _member
-- @include _record

guard_keys('zset', 'hash', 'hash', 'zset', 'hash', 'zset')

local limit, max_deliveries = count_arg(1, 1), count_arg(2, 0)
count_arg(6, 0)
local scan_target, cursor, scan_count = tonumber(ARGV[7] or '0'), ARGV[8] or '0', 0
local lease_ttl = 0
if scan_target ~= 0 then
  if scan_target ~= 2 and scan_target ~= 3 then
    error('claimkit: ARGV[7] must be 0, 2 or 3, got ' .. tostring(ARGV[7]))
  end
  scan_count = count_arg(9, 1)
  lease_ttl = number_arg(10)
  if lease_ttl <= 0 then
    error('claimkit: ARGV[10] must be a number > 0, got ' .. tostring(ARGV[10]))
  end
end
list_usable(ARGV[4], 'the fallback result list')
local now = server_now()
local expired = redis.call('ZRANGE', KEYS[4], '-inf', now, 'BYSCORE', 'LIMIT', 0, limit)
local full = #expired == limit

-- Orphans: read before any write, so a bad cursor fails the call with nothing changed.
-- Those with a payload go to `restore` (their lease back), the others to `expired` (ghosts).
local orphans, next_cursor, capped, stray, restore = 0, '0', false, {}, {}
if scan_target ~= 0 then
  local page = redis.call('HSCAN', KEYS[scan_target], cursor, 'COUNT', scan_count)
  next_cursor = page[1]
  local fields, seen = page[2], {}
  for j = 1, #fields, 2 do
    local id = fields[j]
    -- In <q>:claimed, "<id>:score" is the companion of "<id>" when that field exists (a
    -- claim of id "x:score" cannot coexist with one of "x": claim-4.lua keeps them apart).
    local base = scan_target == 2 and string.match(id, '^(.*):score$')
    local companion = base and redis.call('HEXISTS', KEYS[2], base) == 1
    if not companion and not seen[id] and not redis.call('ZSCORE', KEYS[4], id) then
      seen[id] = true
      -- A score field whose payload is gone is no payload (envelopes are JSON objects).
      if base and tonumber(fields[j + 1]) then stray[id] = true end
      if orphans == scan_count then
        capped = true
        next_cursor = cursor
        break
      end
      orphans = orphans + 1
      local member = not stray[id] and redis.call('HGET', KEYS[2], id)
      if member then
        restore[#restore + 1] = { id, member }
      else
        expired[#expired + 1] = id
      end
    end
  end
end

-- Each claim's payload and a usable score, read before any write.
local members, scores = {}, {}
for k, id in ipairs(expired) do
  local member = not stray[id] and redis.call('HGET', KEYS[2], id)
  members[k] = member
  if member then scores[k] = claim_score(member, redis.call('HGET', KEYS[2], id .. ':score')) end
end
local redelivered, dead, ghosts = 0, 0, 0

-- The orphans' leases, as claim-4.lua would take them now (the deadline from the payload;
-- one that cannot be read gives now + lease_ttl).
for _, entry in ipairs(restore) do
  local deadline = member_deadline(decode_member(entry[2]))
  redis.call('ZADD', KEYS[4], lease_expiry(now, lease_ttl, deadline), entry[1])
end

for k, id in ipairs(expired) do
  local member, score = members[k], scores[k]
  drop_claim(KEYS[2], KEYS[3], KEYS[4], id)
  if not member then
    ghosts = ghosts + 1
  else
    local n = next_delivery(KEYS[5], id)
    if max_deliveries > 0 and n >= max_deliveries then
      redis.call('ZADD', KEYS[6], now, member)
      redis.call('HDEL', KEYS[5], id)
      local doc = decode_member(member)
      local request_token = member_internal(doc, 'request_token') or ''
      local result_key = ARGV[3]
      if result_key == '' then result_key = member_internal(doc, 'result_queue_name') or ARGV[4] end
      -- n counts lease expiries without an ack (<q>:deliveries). The same text as
      -- claimkit.protocol.models.max_deliveries_message (a test compares them).
      local times = 'times'
      if n == 1 then times = 'time' end
      local message = 'lease expired ' .. n .. ' ' .. times
        .. ' without an ack (max_deliveries=' .. max_deliveries .. ')'
      local record = error_record(id, 'MAX_DELIVERIES_EXCEEDED', message)
      push_terminal(ARGV[5] .. id, result_key, record, request_token, tonumber(ARGV[6]), ARGV[4])
      dead = dead + 1
    else
      redis.call('ZADD', KEYS[1], score, member)
      redelivered = redelivered + 1
    end
  end
end
local more = 0
if full or capped then more = 1 end
local capped_flag = 0
if capped then capped_flag = 1 end
return { redelivered, dead, ghosts, more, orphans, next_cursor, capped_flag, #restore }
