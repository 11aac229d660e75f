-- Include: push a terminal record once per request generation (SPEC §3.4).
--
-- The record is pushed when the marker is absent, or when it holds a different
-- non-"1" token than this request's non-empty token (a newer generation of a reused id).
-- The marker then holds the token (or "1" when the request has none).
--
-- marker_key: result-terminal:<id>; result_key: the result list; record: JSON bytes;
-- gen_token: internal.request_token or ""; dedup_ttl: whole seconds, 0 = no expiry.
-- Returns 1 when pushed, 0 when suppressed as a duplicate.
local function push_terminal(marker_key, result_key, record, gen_token, dedup_ttl)
  local prev = redis.call('GET', marker_key)
  if prev and (prev == '1' or gen_token == '' or prev == gen_token) then
    return 0
  end
  redis.call('LPUSH', result_key, record)
  local value = gen_token
  if value == '' then value = '1' end
  if dedup_ttl > 0 then
    redis.call('SET', marker_key, value, 'EX', dedup_ttl)
  else
    redis.call('SET', marker_key, value)
  end
  return 1
end
