-- Include: a terminal record's JSON (docs/protocol.md#terminal-record), byte for byte as
-- claimkit.protocol.models.TerminalRecord.to_json writes it (tests/test_scripts.py compares
-- the two on odd ids). Only a record whose id and text are known only inside Redis is built
-- here (reclaim-6.lua: the expired claims and their delivery counts are found by the script
-- itself); every other script is handed the record's bytes by Python in ARGV.
--
-- json_string(s): s as a JSON string, escaped as Python's json.dumps(ensure_ascii=False)
-- escapes it: '"', '\\' and the control characters below 0x20 (short forms where JSON
-- has them, else \u00xx); DEL and every other byte as is. (cjson.encode would also escape
-- "/" and DEL, so its bytes would differ from the record Python writes for the same id.)
-- error_record(id, code, message): the record of a non-HTTP outcome:
--   {"id":<id>,"payload":"{\"error\":<message>}","error_code":<code>,"error_message":<message>}
local JSON_ESCAPES = {
  ['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f', ['\n'] = '\\n',
  ['\r'] = '\\r', ['\t'] = '\\t',
}

local function json_string(s)
  local body = string.gsub(s, '[%z\1-\31"\\]', function(c)
    return JSON_ESCAPES[c] or string.format('\\u%04x', string.byte(c))
  end)
  return '"' .. body .. '"'
end

local function error_record(id, code, message)
  local payload = '{"error":' .. json_string(message) .. '}'
  return '{"id":' .. json_string(id) .. ',"payload":' .. json_string(payload)
    .. ',"error_code":' .. json_string(code) .. ',"error_message":' .. json_string(message) .. '}'
end
