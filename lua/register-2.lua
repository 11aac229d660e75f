--[[
  Register: a consumer enters the consumer registry of one queue as it starts
  (docs/protocol.md#consumers).

  Input:
    KEYS[1] consumer registry ZSET <q>:consumers
    KEYS[2] consumer info HASH     <q>:consumer-info

    ARGV[1] consumer id
    ARGV[2] liveness ttl, seconds (a number > 0)
    ARGV[3] host name
    ARGV[4] process id (a whole number)
    ARGV[5] claimkit version

  Writes <q>:consumers[id] = server_now + ttl (the liveness expiry, Unix seconds) and
  <q>:consumer-info[id] = JSON {"host", "pid", "started": server_now, "version"}, replacing
  what an earlier consumer of the same id left there.

  Output: { server_now (string, Unix seconds), other } where other is the info JSON the
    entry held when it was still alive (score above server_now) and named another host or
    pid: another live process under the same id (a restarted pod reusing its name shows a
    new pid, but its old entry has lapsed unless it restarted within one TTL); else "".
]]
-- @include _server-now
-- @include _guard-keys
-- @include _liveness

guard_keys('zset', 'hash')
local c = consumer_args(1)
local now = server_now()
local other = ''
local score = tonumber(redis.call('ZSCORE', KEYS[1], c.id))
if score and score > now then
  local raw = redis.call('HGET', KEYS[2], c.id)
  if raw then
    local ok, info = pcall(cjson.decode, raw)
    if ok and type(info) == 'table'
        and (tostring(info.host) ~= c.host or tonumber(info.pid) ~= c.pid) then
      other = raw
    end
  end
end
mark_alive(KEYS[1], KEYS[2], c, now, true)
return { fmt_time(now), other }
