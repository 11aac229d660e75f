--[[
  Push records onto one result list under its dedup markers, in the list's slot: step 2 of
  an ack across slots, and the outbox replay (docs/topology.md#acks-across-slots).

  Idempotent: a record whose marker says it is already there is suppressed (the marker
  rule of lua/_dedup.lua, standalone's), so replaying an entry whose push already happened
  pushes nothing. Every call also removes up to 100 expired markers of the list.
  A list (or marker key) of another type takes no record: the call writes nothing and
  answers "unusable" for every record, and the caller re-aims them at the fallback list
  (the queue's list, else the global one), unless this list is that fallback itself
  (ARGV[2] = "1"): then the call fails with Redis's own WRONGTYPE, having written nothing,
  as standalone's ack does for a fallback list of another type.

  Input:
    KEYS[1] result LIST            L
    KEYS[2] marker HASH            {L}:result-terminal
    KEYS[3] marker expiry ZSET     {L}:result-terminal-expiry

    ARGV[1] dedup ttl, whole seconds (0 = markers never expire)
    ARGV[2] "1" when L is the last resort (the fallback list), else "0"
    then three per record, repeated:
      id, request_token (internal.request_token or ""), record (JSON)

  Output: { code_1, ..., code_n } where code is 1 pushed, 0 suppressed (a duplicate), -1
    unusable (nothing was written for any record).
]]
-- @include _server-now
-- @include _checks
-- @include _guard-keys
-- @include _markers

local dedup_ttl = count_arg(1, 0)
local kind = redis.call('TYPE', KEYS[1])['ok']
if ARGV[2] == '1' or ((kind == 'list' or kind == 'none') and markers_usable(KEYS[2], KEYS[3])) then
  guard_keys('list', 'hash', 'zset')
else
  local out = {}
  for _ = 3, #ARGV, 3 do out[#out + 1] = -1 end
  return out
end

local now = server_now()
sweep_markers(KEYS[2], KEYS[3], now)
local out = {}
for i = 3, #ARGV, 3 do
  local id, request_token, record = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  out[#out + 1] = push_marked(KEYS[1], KEYS[2], KEYS[3], id, record, request_token, dedup_ttl, now)
end
return out
