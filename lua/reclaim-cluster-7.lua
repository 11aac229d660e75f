--[[
  Reclaim in a Redis Cluster: lua/reclaim-6.lua's pass (the same include, lua/_reclaim.lua,
  the same KEYS[1..6] in their cluster names and the same ARGV), except where a dead
  letter's MAX_DELIVERIES_EXCEEDED record goes: its list and that list's dedup markers may
  live in another slot (the list is found inside the script, from the member), so the
  record goes into the queue's outbox, under <id>\0<the claim's owner token> (<id>\0<the
  server time> when the claim had no owner entry), as cjson {"list", "request_token",
  "record", "id"}. The caller then replays the outbox (lua/push-result-3.lua, then HDEL:
  docs/topology.md#acks-across-slots). ARGV[5] and ARGV[6] are checked but not used here:
  the push step applies the marker and its TTL. ARGV[4], the fallback list, is not read
  either (it may live in another slot): the push step checks it.

  Everything else is reclaim-6.lua's description: redelivery at the original score, dead
  letters at max_deliveries, ghosts, the orphan scan and its leases, every check before the
  first write (docs/protocol.md#reclaim).

  Input:
    KEYS[1] pending ZSET           <q>
    KEYS[2] claimed HASH           {q}:claimed
    KEYS[3] owners HASH            {q}:claim-owners
    KEYS[4] lease index ZSET       {q}:claims-idx
    KEYS[5] deliveries HASH        {q}:deliveries
    KEYS[6] dead ZSET              {q}:dead
    KEYS[7] outbox HASH            {q}:outbox

    ARGV[1] limit: at most this many expired claims per call
    ARGV[2] max_deliveries (0 = unlimited)
    ARGV[3] the queue's configured result list, or "" (then the member's
            internal.result_queue_name, then ARGV[4]): the routing rule of
            claimkit.protocol.routing.ResultRouting, which sends both (lua_args)
    ARGV[4] the global result list (also where a record goes when its own list holds
            another type)
    ARGV[5] dedup marker prefix "result-terminal:"
    ARGV[6] dedup ttl, whole seconds (0 = no expiry)
    ARGV[7] orphan scan: 2 scans KEYS[2] (<q>:claimed), 3 scans KEYS[3] (<q>:claim-owners),
            0 or absent: no scan
    ARGV[8] the HSCAN cursor to read from ("0" starts a cycle)
    ARGV[9] scan_count: the HSCAN COUNT, and at most this many orphans per call
    ARGV[10] lease ttl, seconds (a number > 0: the consumers' claim_lease_ttl_seconds),
            the lease an orphan is given back; read only when ARGV[7] is 2 or 3

  Output: { redelivered, dead, ghosts, more, orphans, cursor, capped, leases_restored }
    where redelivered and dead count expired claims, ghosts the entries removed for want
    of a payload (index entries, and orphans with no payload), more is 1 when the limit
    was reached or the scan page held more orphans than scan_count (call again), orphans
    counts the claims without a lease entry handled (each is counted in leases_restored or
    ghosts), cursor is the one to pass next, capped is 1 when that is the same page again
    ("0" and capped 0: this hash's scan cycle is done), and leases_restored counts the
    orphans given their lease entry back.
]]
-- @include _guard-keys
-- @include _checks
-- @include _server-now
-- @include _reclaim
-- @include _outbox

guard_keys('zset', 'hash', 'hash', 'zset', 'hash', 'zset', 'hash')

return reclaim_pass({
  check_args = function() count_arg(6, 0) end,
  check_lists = function() end,
  want_owner = true,
  on_dead = function(id, owner, result_key, record, request_token, now)
    local token = owner or fmt_time(now)
    outbox_put(KEYS[7], id .. '\0' .. token, result_key, request_token, record, id)
  end,
})
