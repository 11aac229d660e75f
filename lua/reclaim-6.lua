--[[
  Reclaim: redeliver claims whose lease expired by server time (docs/protocol.md#reclaim).

  Takes up to `limit` expired claims. Each goes back to pending at its original score with
  its delivery count incremented; one whose count reaches max_deliveries goes to the dead
  set instead and gets a MAX_DELIVERIES_EXCEEDED record (once per generation, carrying the
  member's internal.request_token; its JSON from lua/_record.lua, the bytes
  TerminalRecord.to_json would write). Its payload key, when the member names one, is left
  to its TTL: a dead letter may still be requeued (docs/protocol.md#payload-references). Index
  entries with no claimed payload (ghosts) are removed.

  Claims without a lease entry (orphans: the index entry was evicted, lost in a partial
  restore or deleted by hand) are given their lease back, not redelivered: their owner may
  be alive with the request in flight (docs/protocol.md, "Claims without a lease entry").
  An orphan with a payload (whether or not it has an owner entry) gets
  claims-idx[id] = the lease a claim taken now would get (lua/_lease.lua, the claim rule:
  min(now + ARGV[10], data.deadline + 30), never less than now + min(ARGV[10], 30)); its
  live owner renews it as usual, a dead owner's claim expires one lease later and goes the
  expired way above (its delivery counted, max_deliveries honoured). An orphan with no
  payload (an owner entry or a stray <id>:score field alone) is a ghost and is removed.
  Orphans are found by a bounded scan: each call
  reads one HSCAN page (COUNT scan_count) of <q>:claimed or <q>:claim-owners, as the caller
  asks, and handles at most scan_count orphans; when the page holds more, the cursor is not
  advanced, so the next call reads the same page again (the handled ones are gone by then).
  A payload whose <id>:score field is missing or not a number goes back at its own queue
  score (its data.deadline and enqueue order, lua/_queue-score.lua; 0 when the deadline
  cannot be read either: the peek then dead-letters it as malformed); a payload is never
  dropped. Every read, and every check that could fail, comes
  before the first write (docs/protocol.md, "Scripts never fail half-way").

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
-- @include _push-terminal
-- @include _guard-keys
-- @include _checks
-- @include _reclaim

guard_keys('zset', 'hash', 'hash', 'zset', 'hash', 'zset')

return reclaim_pass({
  check_args = function() count_arg(6, 0) end,
  check_lists = function() list_usable(ARGV[4], 'the fallback result list') end,
  want_owner = false,
  on_dead = function(id, _owner, result_key, record, request_token, _now)
    push_terminal(ARGV[5] .. id, result_key, record, request_token, tonumber(ARGV[6]), ARGV[4])
  end,
})
