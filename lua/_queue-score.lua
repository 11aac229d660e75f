-- Include: a request's pending score (docs/protocol.md#enqueue-order), the one Lua copy of
-- claimkit.protocol.models.queue_score; tests/test_queue_score.py keeps the two byte-equal.
--
-- queue_score(deadline, seq, enqueued_at_ms): deadline (Unix seconds) plus a fraction below
--   1 that orders requests of one deadline by submission:
--   seq >= 1 (internal.enqueue_seq): deadline + min(seq, 2^21 - 1) / 2^21;
--   else enqueued_at_ms >= 1 (older producers, Unix ms): deadline + step / 2^21 where
--   step = offset * 2^21 // H, H = 2^17 * 1000 ms, offset = enqueued_at_ms -
--   (deadline * 1000 - H) held to [0, H - 1];
--   else the bare deadline. seq and enqueued_at_ms are nil when absent.
--   Double arithmetic, as Go's float64: one exact division, one rounded addition. Every
--   product stays below 2^53, so the floor of the step's quotient is exact.
-- format_score(score): the score as a ZADD is sent it, '%.17g' (Lua's tostring would keep
--   only 14 digits and move the request).
-- member_queue_score(doc): the formatted score of a decoded member (its data.deadline and
--   internal.enqueue_seq / internal.enqueued_at_ms; a field that is not a whole number is
--   ignored), or nil when its data.deadline cannot be read. Never fails.
-- @include _member

local SCORE_STEPS = 2097152 -- 2^21
local HORIZON_MS = 131072000 -- 2^17 * 1000

local function queue_score(deadline, seq, enqueued_at_ms)
  if seq and seq >= 1 then
    return deadline + math.min(seq, SCORE_STEPS - 1) / SCORE_STEPS
  end
  if enqueued_at_ms and enqueued_at_ms >= 1 then
    local offset = enqueued_at_ms - (deadline * 1000 - HORIZON_MS)
    offset = math.min(math.max(offset, 0), HORIZON_MS - 1)
    local step = math.floor(offset * SCORE_STEPS / HORIZON_MS)
    return deadline + step / SCORE_STEPS
  end
  return deadline
end

local function format_score(score)
  return string.format('%.17g', score)
end

-- A JSON number with no fraction (cjson gives every number as a double), else nil.
local function whole_number(v)
  if type(v) == 'number' and v == v and v ~= math.huge and v ~= -math.huge
      and v == math.floor(v) then
    return v
  end
  return nil
end

local function member_queue_score(doc)
  local deadline = member_deadline(doc)
  if deadline == nil then return nil end
  local internal = doc.internal
  local seq, enqueued_at_ms = nil, nil
  if type(internal) == 'table' then
    seq = whole_number(internal.enqueue_seq)
    enqueued_at_ms = whole_number(internal.enqueued_at_ms)
  end
  return format_score(queue_score(deadline, seq, enqueued_at_ms))
end
