--[[
  Dead-letter malformed pending members (docs/protocol.md#peek): nothing is ever silently dropped.

  Each member is moved by its exact bytes from pending to the dead set; when an id could be
  read, an INVALID_REQUEST record is pushed once per generation.

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] dead ZSET              <q>:dead

    ARGV[1] dedup ttl, whole seconds (0 = no expiry)
    ARGV[2] fallback result list: where a record goes when its own list holds another type
    then five per member, repeated:
      member (exact bytes), request_token (internal.request_token, "" when unreadable), marker_key ("" = no record),
      result_key, record (JSON)

  Output: { moved_1, pushed_1, ..., moved_n, pushed_n }: moved is 1 when this call moved
    the member (0: another consumer already did); pushed is 1 when the record was pushed.
]]
-- @include _server-now
-- @include _push-terminal
-- @include _guard-keys
-- @include _checks

guard_keys('zset', 'zset')

local dedup_ttl, fallback = count_arg(1, 0), ARGV[2]
list_usable(fallback, 'the fallback result list')
local now = server_now()
local out = {}

for i = 3, #ARGV, 5 do
  local member, marker_key = ARGV[i], ARGV[i + 2]
  local moved, pushed = 0, 0
  if redis.call('ZREM', KEYS[1], member) == 1 then
    redis.call('ZADD', KEYS[2], now, member)
    moved = 1
    if marker_key ~= '' then
      pushed = push_terminal(marker_key, ARGV[i + 3], ARGV[i + 4], ARGV[i + 1], dedup_ttl, fallback)
    end
  end
  out[#out + 1] = moved
  out[#out + 1] = pushed
end
return out
