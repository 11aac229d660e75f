-- Include: the lease rule (docs/protocol.md#claim), the one copy: claim-4.lua (a claim
-- taken), renew-2.lua (a heartbeat) and reclaim-6.lua (a lease given back) all use it.
--
-- lease_expiry(now, lease_ttl, deadline): the expiry, Unix seconds, of a lease taken,
-- renewed or given back at server time `now`: min(now + lease_ttl, deadline + 30), but
-- never less than now + min(lease_ttl, 30) (a request whose deadline already passed still
-- gets time for its DEADLINE_EXCEEDED ack). deadline nil (unreadable): now + lease_ttl.
local function lease_expiry(now, lease_ttl, deadline)
  if not deadline then return now + lease_ttl end
  local expiry = math.min(now + lease_ttl, deadline + 30)
  return math.max(expiry, now + math.min(lease_ttl, 30))
end
