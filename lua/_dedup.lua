-- Include: the dedup rule of a terminal record (docs/protocol.md#dedup-marker), the one copy:
-- lua/_push-terminal.lua (a marker key per request) and lua/_markers.lua (the cluster
-- layout's marker hash per destination list) both ask it.
--
-- is_duplicate(prev, request_token): whether a record of the generation request_token
-- ("" when the request has none) is already recorded by the marker value prev (nil or false,
-- Redis's nil reply: no marker). It is when the marker holds "1", or this request has no
-- token, or the marker holds this very token; a marker holding another token is an older
-- generation of a reused id, and the record is pushed.
local function is_duplicate(prev, request_token)
  if not prev then return false end
  return prev == '1' or request_token == '' or prev == request_token
end
