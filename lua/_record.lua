-- Include: a terminal record's JSON (docs/protocol.md#terminal-record), byte for byte as
-- claimkit.protocol.models.TerminalRecord.to_json writes it (tests/test_scripts.py compares
-- the two on odd ids). Only a record whose id and text are known only inside Redis is built
-- here (reclaim-6.lua: the expired claims and their delivery counts are found by the script
-- itself); every other script is handed the record's bytes by Python in ARGV.
--
-- json_string(s): s as a JSON string. cjson writes "/" as "\/" where Python's json writes
-- "/"; cjson escapes every "/" it writes, so undoing that cannot touch anything else.
-- error_record(id, code, message): the record of a non-HTTP outcome:
--   {"id":<id>,"payload":"{\"error\":<message>}","error_code":<code>,"error_message":<message>}
local function json_string(s)
  return (string.gsub(cjson.encode(s), '\\/', '/'))
end

local function error_record(id, code, message)
  local payload = '{"error":' .. json_string(message) .. '}'
  return '{"id":' .. json_string(id) .. ',"payload":' .. json_string(payload)
    .. ',"error_code":' .. json_string(code) .. ',"error_message":' .. json_string(message) .. '}'
end
