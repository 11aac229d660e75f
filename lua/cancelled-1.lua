--[[
  Read one request's cancel marker, after its claim, in a Redis Cluster: the marker lives in
  the request's own slot, which the claim script cannot declare
  (docs/topology.md#retries-cancellation-and-the-producer). Read-only.

  A marker of another type than a string cannot hold the token: not cancelled
  (guarded_get, as lua/claim-4.lua reads it in standalone).

  Input:
    KEYS[1] cancel marker STRING   request-cancel:<id>

    ARGV[1] request_token (internal.request_token of the claimed generation, not "")

  Output: 1 when the marker holds ARGV[1] (cancelled), else 0.
]]
-- @flags no-writes
-- @include _guard-keys

if guarded_get(KEYS[1]) == ARGV[1] then return 1 end
return 0
