-- Include: the reclaim pass (docs/protocol.md#reclaim), the one copy: lua/reclaim-6.lua
-- (standalone) and lua/reclaim-cluster-7.lua (cluster) run it; their headers give KEYS[1..6]
-- and ARGV[1..10], the same in both.
--
-- reclaim_pass(hooks): one pass; returns the script's reply. hooks:
--   check_args(): the script's own ARGV checks, run where every check runs (before the
--     first write);
--   check_lists(): the script's check of the lists it may write, likewise;
--   want_owner: whether on_dead needs the claim's owner token;
--   on_dead(id, owner, result_key, record, request_token, now): where the
--     MAX_DELIVERIES_EXCEEDED record of a dead-lettered claim goes (owner: its token, or nil;
--     result_key: its list by the routing rule; record: its JSON from lua/_record.lua). It
--     must not fail: it runs after writes.
-- @include _server-now
-- @include _drop-claim
-- @include _guard-keys
-- @include _checks
-- @include _lease
-- @include _member
-- @include _record

local function reclaim_pass(hooks)
  local limit, max_deliveries = count_arg(1, 1), count_arg(2, 0)
  hooks.check_args()
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
  hooks.check_lists()
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
    local owner = hooks.want_owner and redis.call('HGET', KEYS[3], id) or nil
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
        local record = error_record(id, 'MAX_DELIVERIES_EXCEEDED', message, request_token)
        hooks.on_dead(id, owner, result_key, record, request_token, now)
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
end
