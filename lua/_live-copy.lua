-- Include: lua/ack-5.lua's live-copy rule (docs/protocol.md#ack) as the cluster acks apply
-- it, the one copy: lua/ack-local-9.lua and lua/ack-outbox-6.lua (their KEYS[1..5] are
-- pending, claimed, owners, lease index, deliveries).
--
-- take_live_copy(id, token, member): end the request's one live copy: 1 when the caller's
--   token still owns the claim (its entries deleted), 2 when the exact member was pending
--   again (withdrawn), its delivery count deleted either way; 0 when neither, nothing
--   written (the request lives on under another owner or in the retry set, or is done).
-- @include _drop-claim

local function take_live_copy(id, token, member)
  local code = 0
  if redis.call('HGET', KEYS[3], id) == token then
    drop_claim(KEYS[2], KEYS[3], KEYS[4], id)
    code = 1
  elseif redis.call('ZREM', KEYS[1], member) == 1 then
    code = 2
  end
  if code ~= 0 then redis.call('HDEL', KEYS[5], id) end
  return code
end
