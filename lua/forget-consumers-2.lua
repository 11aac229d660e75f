--[[
  Forget consumers: remove entries from the consumer registry and their info
  (docs/protocol.md#consumers). The graceful shutdown removes its own entry after its
  sweep; `claimkit consumers --forget-dead` removes the dead ones.

  Input:
    KEYS[1] consumer registry ZSET <q>:consumers
    KEYS[2] consumer info HASH     <q>:consumer-info

    ARGV[1] "any": forget each consumer named in ARGV[2..] whatever its state;
            "dead": forget those named whose liveness lapsed (score below server_now: a
            lapsed entry, or one marked handled), or, when none is named, every such one
    ARGV[2..] consumer ids

  Info entries without a registry entry are forgotten along with them ("dead" with no ids:
  every info entry whose consumer has no registry entry).

  Output: { forgotten, id_1, ..., id_n }: how many registry entries were removed, and
    their ids.
]]
-- @include _server-now
-- @include _guard-keys

guard_keys('zset', 'hash')
local mode = ARGV[1]
if mode ~= 'any' and mode ~= 'dead' then
  error('claimkit: ARGV[1] must be "any" or "dead", got ' .. tostring(mode))
end
local now = server_now()
local ids = {}
for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
local everyone = mode == 'dead' and #ids == 0
if everyone then
  ids = redis.call('ZRANGE', KEYS[1], '-inf', '(' .. fmt_time(now), 'BYSCORE')
end

local out = { 0 }
for _, id in ipairs(ids) do
  local score = tonumber(redis.call('ZSCORE', KEYS[1], id))
  if mode == 'any' or (score and score < now) then
    if score then
      redis.call('ZREM', KEYS[1], id)
      out[1] = out[1] + 1
      out[#out + 1] = id
    end
    redis.call('HDEL', KEYS[2], id)
  elseif not score then
    redis.call('HDEL', KEYS[2], id)
  end
end
if everyone then
  for _, id in ipairs(redis.call('HKEYS', KEYS[2])) do
    if not redis.call('ZSCORE', KEYS[1], id) then redis.call('HDEL', KEYS[2], id) end
  end
end
return out
