-- Include: push a terminal record once per request generation (docs/protocol.md#ack).
--
-- The record is pushed when the marker is absent, or when it holds a different
-- non-"1" token than this request's non-empty token (a newer generation of a reused id).
-- The marker then holds the token (or "1" when the request has none).
--
-- marker_key: result-terminal:<id>; result_key: the result list; record: JSON bytes;
-- request_token: internal.request_token or ""; dedup_ttl: whole seconds, 0 = no expiry;
-- fallback_key: the list used instead when result_key cannot take the record.
-- Returns 1 when pushed, 0 when suppressed as a duplicate.
--
-- A member's internal.result_queue_name may name any key (docs/protocol.md#result-routing).
-- One that holds another type would fail the LPUSH after earlier writes of the same script
-- (a script is not rolled back): the record goes to fallback_key instead. So does one aimed
-- at its own marker key (the SET below would overwrite the list) or at one of the calling
-- script's KEYS (the queue's own keys: while empty they do not exist, and the LPUSH would
-- turn one into a list, breaking the queue).
--
-- A marker key of another type is no marker (claimkit only ever SETs strings there): the
-- record is pushed and the SET below replaces it. Failing instead would fail the calling
-- script after its earlier writes; in the reclaim script it would fail every reclaim pass
-- of the queue from then on.
-- @include _guard-keys
-- @include _dedup
local function push_terminal(marker_key, result_key, record, request_token, dedup_ttl, fallback_key)
  if is_duplicate(guarded_get(marker_key), request_token) then
    return 0
  end
  local kind = redis.call('TYPE', result_key)['ok']
  local usable = result_key ~= marker_key and (kind == 'list' or kind == 'none')
  for _, key in ipairs(KEYS) do
    if key == result_key then usable = false end
  end
  if not usable then result_key = fallback_key end
  redis.call('LPUSH', result_key, record)
  local value = request_token
  if value == '' then value = '1' end
  if dedup_ttl > 0 then
    redis.call('SET', marker_key, value, 'EX', dedup_ttl)
  else
    redis.call('SET', marker_key, value)
  end
  return 1
end
