-- Include: a terminal record's JSON (docs/protocol.md#terminal-record), byte for byte as
-- claimkit.protocol.models.TerminalRecord.to_json writes it, which is how llm-d-async's Go
-- (encoding/json) writes the same record (tests/test_scripts.py compares the two on odd
-- ids). Only a record whose id and text are known only inside Redis is built here
-- (reclaim-6.lua, reclaim-cluster-7.lua: the expired claims and their delivery counts are
-- found by the script itself); every other script is handed the record's bytes in ARGV.
--
-- json_string(s): s as a JSON string, escaped as Go's encoding/json escapes it: '"', '\\',
--   \n \r \t \b \f in their short forms, the other control characters below 0x20 as
--   \u00xx, '<' '>' '&' as \u003c \u003e \u0026, U+2028 and U+2029 as \u2028 \u2029, each
--   byte that is not part of a valid UTF-8 sequence as \ufffd; DEL and all other UTF-8 as
--   is. (cjson.encode escapes "/" and DEL and not '<', so its bytes would differ.)
-- error_record(id, code, message, request_token): the record of a non-HTTP outcome:
--   {"id":<id>,"payload":"{\"error\":<message>}","error_code":<code>,
--    "error_message":<message>,"request_token":<request_token>}
--   error_message is left out when message is '', request_token when it is nil or ''.
local JSON_ESCAPES = {
  ['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f', ['\n'] = '\\n',
  ['\r'] = '\\r', ['\t'] = '\\t', ['<'] = '\\u003c', ['>'] = '\\u003e', ['&'] = '\\u0026',
}

-- The length of the valid UTF-8 sequence starting at byte i of s (its first byte is
-- >= 0x80), or nil: Go's utf8.DecodeRune rules (no overlong forms, no surrogates, nothing
-- above U+10FFFF).
local function utf8_length(s, i)
  local b1, b2, b3, b4 = string.byte(s, i, i + 3)
  local function cont(b) return b and b >= 0x80 and b <= 0xBF end
  if b1 >= 0xC2 and b1 <= 0xDF then
    if cont(b2) then return 2 end
  elseif b1 >= 0xE0 and b1 <= 0xEF then
    local lo, hi = 0x80, 0xBF
    if b1 == 0xE0 then lo = 0xA0 elseif b1 == 0xED then hi = 0x9F end
    if b2 and b2 >= lo and b2 <= hi and cont(b3) then return 3 end
  elseif b1 >= 0xF0 and b1 <= 0xF4 then
    local lo, hi = 0x80, 0xBF
    if b1 == 0xF0 then lo = 0x90 elseif b1 == 0xF4 then hi = 0x8F end
    if b2 and b2 >= lo and b2 <= hi and cont(b3) and cont(b4) then return 4 end
  end
  return nil
end

local function json_string(s)
  local out, i, n = { '"' }, 1, #s
  while i <= n do
    local j = string.find(s, '[%z\1-\31"\\<>&\128-\255]', i)
    if not j then
      out[#out + 1] = string.sub(s, i)
      break
    end
    if j > i then out[#out + 1] = string.sub(s, i, j - 1) end
    local c = string.sub(s, j, j)
    local b = string.byte(c)
    if b < 0x80 then
      out[#out + 1] = JSON_ESCAPES[c] or string.format('\\u%04x', b)
      i = j + 1
    else
      local len = utf8_length(s, j)
      if not len then
        out[#out + 1] = '\\ufffd'
        i = j + 1
      else
        local seq = string.sub(s, j, j + len - 1)
        if seq == '\226\128\168' then
          seq = '\\u2028'
        elseif seq == '\226\128\169' then
          seq = '\\u2029'
        end
        out[#out + 1] = seq
        i = j + len
      end
    end
  end
  out[#out + 1] = '"'
  return table.concat(out)
end

local function error_record(id, code, message, request_token)
  local payload = '{"error":' .. json_string(message) .. '}'
  local record = '{"id":' .. json_string(id) .. ',"payload":' .. json_string(payload)
    .. ',"error_code":' .. json_string(code)
  if message ~= '' then record = record .. ',"error_message":' .. json_string(message) end
  if request_token and request_token ~= '' then
    record = record .. ',"request_token":' .. json_string(request_token)
  end
  return record .. '}'
end
