--[[
  Reclaim: redeliver claims whose lease expired by server time (SPEC §3.7).

  Takes up to `limit` expired claims. Each goes back to pending at its original score with
  its delivery count incremented; one whose count reaches max_deliveries goes to the dead
  set instead and gets a MAX_DELIVERIES_EXCEEDED record (once per generation). Index
  entries with no claimed payload (ghosts) are removed.

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
            internal.result_queue_name, then ARGV[4])
    ARGV[4] the global result list (also where a record goes when its own list holds
            another type)
    ARGV[5] dedup marker prefix "result-terminal:"
    ARGV[6] dedup ttl, whole seconds (0 = no expiry)

  Output: { redelivered, dead, ghosts, more } where more is 1 when the limit was reached.
]]
-- @include _server-now
-- @include _push-terminal
-- @include _drop-claim
-- @include _guard-keys

guard_keys('zset', 'hash', 'hash', 'zset', 'hash', 'zset')

local limit, max_deliveries = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = server_now()
local expired = redis.call('ZRANGE', KEYS[4], '-inf', now, 'BYSCORE', 'LIMIT', 0, limit)
local redelivered, dead, ghosts = 0, 0, 0

for _, id in ipairs(expired) do
  local member = redis.call('HGET', KEYS[2], id)
  local score = redis.call('HGET', KEYS[2], id .. ':score')
  drop_claim(KEYS[2], KEYS[3], KEYS[4], id)
  if not member or not score then
    ghosts = ghosts + 1
  else
    local n = redis.call('HINCRBY', KEYS[5], id, 1)
    if max_deliveries > 0 and n >= max_deliveries then
      redis.call('ZADD', KEYS[6], now, member)
      redis.call('HDEL', KEYS[5], id)
      local gen_token, result_key = '', ARGV[3]
      local ok, doc = pcall(cjson.decode, member)
      if ok and type(doc) == 'table' and type(doc.internal) == 'table' then
        if type(doc.internal.request_token) == 'string' then
          gen_token = doc.internal.request_token
        end
        if result_key == '' and type(doc.internal.result_queue_name) == 'string'
            and doc.internal.result_queue_name ~= '' then
          result_key = doc.internal.result_queue_name
        end
      end
      if result_key == '' then result_key = ARGV[4] end
      -- n counts lease expiries without an ack (<q>:deliveries). The same text as
      -- claimkit._models.max_deliveries_message (a test compares them).
      local times = 'times'
      if n == 1 then times = 'time' end
      local message = 'lease expired ' .. n .. ' ' .. times
        .. ' without an ack (max_deliveries=' .. max_deliveries .. ')'
      local record = '{"id":' .. cjson.encode(id)
        .. ',"payload":' .. cjson.encode(cjson.encode({ error = message }))
        .. ',"error_code":"MAX_DELIVERIES_EXCEEDED","error_message":' .. cjson.encode(message) .. '}'
      push_terminal(ARGV[5] .. id, result_key, record, gen_token, tonumber(ARGV[6]), ARGV[4])
      dead = dead + 1
    else
      redis.call('ZADD', KEYS[1], score, member)
      redelivered = redelivered + 1
    end
  end
end
local more = 0
if #expired == limit then more = 1 end
return { redelivered, dead, ghosts, more }
