-- Include: the lease rule (docs/protocol.md#claim, docs/protocol.md#heartbeat), the one copy:
-- claim-4.lua (a claim taken), reclaim-6.lua (a lease given back) and renew-4.lua (a
-- heartbeat) all use it. Times are Unix seconds on the server clock.
--
-- lease_bound(now, lease_ttl, deadline): how far a lease may reach at `now`:
-- min(now + lease_ttl, deadline + 30). deadline nil (unreadable): now + lease_ttl.
local function lease_bound(now, lease_ttl, deadline)
  if not deadline then return now + lease_ttl end
  return math.min(now + lease_ttl, deadline + 30)
end

-- lease_expiry(now, lease_ttl, deadline): the expiry of a lease granted at `now` (a claim
-- taken, a lease given back): lease_bound, but never less than now + min(lease_ttl, 30), so
-- a request whose deadline already passed still gets time for its DEADLINE_EXCEEDED ack.
-- A heartbeat renews to lease_bound and never shortens a lease (ZADD GT): the grant's floor
-- holds, and no renewal carries a lease past max(the grant, deadline + 30).
local function lease_expiry(now, lease_ttl, deadline)
  return math.max(lease_bound(now, lease_ttl, deadline), now + math.min(lease_ttl, 30))
end
