-- Include: reading a member's fields (docs/protocol.md#envelope), the one decoder every
-- script uses. A member is JSON from any producer: each reader returns nil when its field
-- is absent, of another type or unreadable, and none of them can fail the script (a script
-- keeps every write it made before a failure: Redis has no rollback).
--
-- decode_member(member): the decoded JSON object (a Lua table), or nil.
-- member_deadline(doc): data.deadline, Unix seconds, as a number that is not NaN, or nil.
-- member_id(doc): data.id when it is a non-empty string, or nil.
-- member_internal(doc, field): internal.<field> (request_token, result_queue_name,
--   request_queue_name) when it is a non-empty string, or nil.
local function decode_member(member)
  local ok, doc = pcall(cjson.decode, member)
  if ok and type(doc) == 'table' then return doc end
  return nil
end

local function member_deadline(doc)
  local data = doc and doc.data
  if type(data) == 'table' and type(data.deadline) == 'number' and data.deadline == data.deadline then
    return data.deadline
  end
  return nil
end

local function member_id(doc)
  local data = doc and doc.data
  if type(data) == 'table' and type(data.id) == 'string' and data.id ~= '' then return data.id end
  return nil
end

local function member_internal(doc, field)
  local internal = doc and doc.internal
  if type(internal) == 'table' and type(internal[field]) == 'string' and internal[field] ~= '' then
    return internal[field]
  end
  return nil
end
