"""Wire models: the request envelope and the terminal record.

Their fields: docs/protocol.md#envelope and docs/protocol.md#terminal-record.

A member is validated with msgspec, whose errors name the offending field
(``Expected `int`, got `str` - at `$.data.deadline```). The parsed view is only used to
decide what to do with a request: the member itself is always moved by its exact original
bytes, and the one rewrite claimkit makes (the retry copy, docs/protocol.md#park-for-retry)
edits a plain ``dict`` so unknown fields survive.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from claimkit.protocol import keys as _keys

__all__ = [
    "DEADLINE_EXCEEDED_MESSAGE",
    "DEADLINE_INVALID_MESSAGE",
    "DEADLINE_RANGE_MESSAGE",
    "ENQUEUED_AT_HORIZON_MS",
    "ENQUEUE_STEPS",
    "LAST_RESPONSE_FIELD",
    "LAST_RESPONSE_MAX_BYTES",
    "MAX_DEADLINE",
    "PAYLOAD_MISSING_MESSAGE",
    "PAYLOAD_NOT_JSON_MESSAGE",
    "Envelope",
    "ErrorCode",
    "Invalid",
    "TerminalRecord",
    "deadline_passed",
    "deadline_record",
    "format_score",
    "go_json",
    "max_deliveries_message",
    "parse_member",
    "queue_score",
    "retry_member",
    "retry_queue_name",
    "utf8_text",
]

DEADLINE_INVALID_MESSAGE = "Failed: deadline is missing or invalid (Unix seconds)."

MAX_DEADLINE = 253402300799
"""The latest ``data.deadline`` a member may carry: 9999-12-31T23:59:59Z in Unix seconds.

The envelope (docs/protocol.md#envelope) only asks for a JSON integer > 0; this bound is a
claimkit addition shared by the producer and the consumer. A larger deadline cannot be a
real one, does not fit Redis's ``PXAT`` (the producer's ``SET request-active:<id>`` failed
after its ``ZADD`` had already run in the same MULTI/EXEC), and a very large one overflows a
float. Such a member is dead-lettered with :data:`DEADLINE_RANGE_MESSAGE`; the producer
refuses it."""

DEADLINE_RANGE_MESSAGE = (
    f"Failed: deadline is out of range: at most {MAX_DEADLINE} Unix seconds (9999-12-31T23:59:59Z)."
)
"""``error_message`` of the ``INVALID_REQUEST`` record of a member whose ``data.deadline``
is an integer above :data:`MAX_DEADLINE` (one of the precise reasons listed in
docs/protocol.md#error-codes)."""

LAST_RESPONSE_FIELD = "claimkit_last_response"
"""The ``internal`` field of a retry member that carries the last HTTP response of the
request (``{"status_code": 429, "payload": "<body>"}``), so that when the deadline ends the
request after it was parked, that response is its record (docs/configuration.md). A name
of claimkit's own, so it cannot collide with llm-d-async's fields; unknown fields are kept
by both when a member is rewritten."""

LAST_RESPONSE_MAX_BYTES = 65536
"""The most body bytes (UTF-8) a retry member carries in :data:`LAST_RESPONSE_FIELD`; a
longer body is cut there (at a character boundary). 429 and 5xx bodies are small; the
bound keeps a pathological one from bloating every pending and retry member."""

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
StrMap = dict[str, str]


class _Data(msgspec.Struct, omit_defaults=True):
    id: NonEmpty
    deadline: Annotated[int, msgspec.Meta(gt=0, le=MAX_DEADLINE)]
    created: int | None = None
    payload: dict[str, Any] | None = None
    metadata: StrMap | None = None
    headers: StrMap | None = None
    endpoint: str | None = None
    request_queue_name: str | None = None
    result_queue_name: str | None = None


class _Internal(msgspec.Struct, omit_defaults=True):
    retry_count: int = 0
    queue_id: str | None = None
    request_token: str | None = None
    request_queue_name: str | None = None
    result_queue_name: str | None = None
    payload_ref: str | None = None
    transport_correlation_id: str | None = None
    # The enqueue order (queue_score). Read leniently (parse_member): a value that is not a
    # whole JSON number is ignored, and the member keeps its bare deadline as its score.
    enqueued_at_ms: Any = None
    enqueue_seq: Any = None
    labels: StrMap | None = None
    # Read leniently (parse_member): a damaged copy must not make the request invalid.
    claimkit_last_response: Any = None


class _Wire(msgspec.Struct):
    request_kind: Literal["plain", "redis", "pubsub"]
    data: _Data
    internal: _Internal = msgspec.field(default_factory=_Internal)


_decoder = msgspec.json.Decoder(_Wire)


class ErrorCode:
    """``error_code`` values of non-HTTP terminal records (docs/protocol.md#terminal-record)."""

    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    GATE_DROPPED = "GATE_DROPPED"
    GATE_ERROR = "GATE_ERROR"
    INFERENCE_ERROR = "INFERENCE_ERROR"
    INVALID_REQUEST = "INVALID_REQUEST"
    MAX_DELIVERIES_EXCEEDED = "MAX_DELIVERIES_EXCEEDED"
    PAYLOAD_UNAVAILABLE = "PAYLOAD_UNAVAILABLE"


PAYLOAD_MISSING_MESSAGE = "request payload is missing"
"""``error_message`` of the ``PAYLOAD_UNAVAILABLE`` record of a request whose payload key
(``internal.payload_ref``) holds nothing when it is fetched (docs/protocol.md#payload-references);
llm-d-async's text."""

PAYLOAD_NOT_JSON_MESSAGE = "request payload is not a JSON object or null"
"""``error_message`` of the ``PAYLOAD_UNAVAILABLE`` record of a request whose payload key holds
something else than one JSON object or ``null``, what a member may carry inline (claimkit
sends JSON bodies; docs/protocol.md#payload-references). A claimkit addition."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """A valid pending member, parsed (docs/protocol.md#envelope).

    Attributes:
        raw: the member's exact bytes as stored in Redis; what every script moves.
        id: ``data.id``.
        deadline: ``data.deadline``, Unix seconds.
        request_token: ``internal.request_token`` or ``""`` (the request generation).
        enqueue_seq: ``internal.enqueue_seq`` when it is a whole JSON number, else ``None``
            (docs/protocol.md#enqueue-order).
        enqueued_at_ms: ``internal.enqueued_at_ms`` (Unix milliseconds) when it is a whole
            JSON number, else ``None``: the older producers' enqueue order.
        last_response: the record of the last HTTP response an earlier attempt had, from
            :data:`LAST_RESPONSE_FIELD` (``None`` when there was none, or it is damaged).
        payload_ref: ``internal.payload_ref``: the key that holds the request's payload
            (``request-payload:<id>:<request_token>``, checked by :func:`parse_member`), or
            ``None`` when the member carries its payload itself
            (docs/protocol.md#payload-references).
        body: the payload fetched through :attr:`payload_ref`, its exact stored bytes: the
            HTTP body sent instead of :attr:`payload`. Only the copy handed to a worker's
            handler carries it (docs/dispatch.md#body); ``None`` otherwise.
    """

    raw: bytes
    id: str
    deadline: int
    request_kind: str
    payload: dict[str, Any] | None
    metadata: dict[str, str]
    headers: dict[str, str]
    endpoint: str | None
    request_token: str
    retry_count: int
    result_queue_name: str | None
    last_response: TerminalRecord | None = None
    payload_ref: str | None = None
    body: bytes | None = None
    enqueue_seq: int | None = None
    enqueued_at_ms: int | None = None

    def body_bytes(self) -> bytes:
        """The HTTP body of this request (docs/dispatch.md#body): :attr:`body`, the fetched
        payload's exact bytes, when there is one; else ``data.payload`` as compact JSON
        (``null`` when it has none)."""
        if self.body is not None:
            return self.body
        return msgspec.json.encode(self.payload)

    @property
    def score(self) -> float:
        """The member's pending score, from its deadline and enqueue order
        (:func:`queue_score`; docs/protocol.md#enqueue-order)."""
        return queue_score(self.deadline, self.enqueue_seq, self.enqueued_at_ms)


@dataclass(frozen=True, slots=True)
class Invalid:
    """A member that cannot be served (docs/protocol.md#peek): it is dead-lettered.

    Attributes:
        raw: the exact member bytes.
        reason: the precise ``error_message`` of its ``INVALID_REQUEST`` record.
        id: the request id when one could still be read, else ``None`` (no record then).
        request_token: the generation token when readable, else ``""``.
        result_queue_name: ``internal.result_queue_name`` when readable.
    """

    raw: bytes
    reason: str
    id: str | None
    request_token: str = ""
    result_queue_name: str | None = None


def deadline_passed(deadline: float, now: float) -> bool:
    """The one deadline rule: a request whose ``data.deadline`` (Unix seconds) is at or
    before ``now`` (Unix seconds, the server clock as the caller estimates it) has passed
    its deadline. The producer then refuses it ("deadline has already expired",
    docs/protocol.md#producer); the consumer still claims it and acks it with
    :func:`deadline_record` (docs/protocol.md#claim) instead of sending it."""
    return deadline <= now


ENQUEUE_STEPS = 1 << 21
"""The enqueue order's steps per second of deadline: a pending score is ``deadline +
step / ENQUEUE_STEPS`` with ``0 <= step < ENQUEUE_STEPS`` (docs/protocol.md#enqueue-order)."""

ENQUEUED_AT_HORIZON_MS = (1 << 17) * 1000
"""How far before its deadline an ``internal.enqueued_at_ms`` still orders a request, in
milliseconds (2^17 s, about 36 hours; the older producers' rule): steps of 62.5 ms."""


def queue_score(deadline: int, enqueue_seq: int | None, enqueued_at_ms: int | None) -> float:
    """The pending score of a request (docs/protocol.md#enqueue-order): its deadline (Unix
    seconds), plus a fraction below 1 that orders requests of one deadline by submission.

    - ``enqueue_seq`` >= 1 (what claimkit and the newest llm-d-async producers write: the
      count of the queue's ``request-seq:<q>:<deadline>`` counter): ``deadline +
      min(enqueue_seq, 2^21 - 1) / 2^21``. From the 2,097,151st submission of one deadline
      on, the scores tie.
    - else ``enqueued_at_ms`` >= 1 (older producers: the submission time, Unix
      milliseconds): ``deadline + step / 2^21``, ``step = offset * 2^21 //
      ENQUEUED_AT_HORIZON_MS`` where ``offset`` is how long after ``deadline * 1000 -
      ENQUEUED_AT_HORIZON_MS`` it was submitted, held to ``[0, ENQUEUED_AT_HORIZON_MS - 1]``.
    - else (neither, or neither positive) the bare deadline.

    When both are there, ``enqueue_seq`` wins. The arithmetic is IEEE double precision
    (one exact division, one rounded addition), as Go's ``float64`` and Lua's numbers do it,
    so ``lua/_queue-score.lua`` gives the same score for the same member (a test keeps the
    two equal). The fraction is exact up to deadlines below 2^32 (year 2106); beyond, the
    sum rounds to the double nearest it, so neighbouring steps may tie and, from 2^32 on,
    the capped step rounds up to ``deadline + 1``: Go's ``float64`` rounds the same way.

    Args:
        deadline: ``data.deadline``, Unix seconds.
        enqueue_seq: ``internal.enqueue_seq``, or ``None``.
        enqueued_at_ms: ``internal.enqueued_at_ms`` (Unix milliseconds), or ``None``.

    Returns:
        The score, a float; :func:`format_score` writes it as Redis is sent it.
    """
    if enqueue_seq is not None and enqueue_seq >= 1:
        return deadline + min(enqueue_seq, ENQUEUE_STEPS - 1) / ENQUEUE_STEPS
    if enqueued_at_ms is not None and enqueued_at_ms >= 1:
        horizon = ENQUEUED_AT_HORIZON_MS
        offset = min(max(enqueued_at_ms - (deadline * 1000 - horizon), 0), horizon - 1)
        step = offset * ENQUEUE_STEPS // horizon
        return deadline + step / ENQUEUE_STEPS
    return float(deadline)


def format_score(score: float) -> str:
    """``score`` as it is sent in a ``ZADD``: ``%.17g``, 17 significant digits, enough to
    give Redis the exact double back (Lua's ``tostring`` keeps only 14). The scripts format
    with the same ``string.format('%.17g', ...)``."""
    return f"{score:.17g}"


DEADLINE_EXCEEDED_MESSAGE = "deadline exceeded"
"""``error_message`` of a ``DEADLINE_EXCEEDED`` record (docs/protocol.md#error-codes)."""


def deadline_record(env: Envelope, last: TerminalRecord | None = None) -> TerminalRecord:
    """The record of a request its deadline ended
    (docs/dispatch.md#the-deadline-ends-retries): ``last``, the last HTTP response of the
    attempt just made, else the one an earlier attempt left in the member
    (:attr:`Envelope.last_response`), else ``DEADLINE_EXCEEDED`` with
    :data:`DEADLINE_EXCEEDED_MESSAGE`."""
    if last is None:
        last = env.last_response
    if last is not None:
        return last
    return TerminalRecord.error(env.id, ErrorCode.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED_MESSAGE)


def max_deliveries_message(expiries: int, max_deliveries: int) -> str:
    """The ``error_message`` of a ``MAX_DELIVERIES_EXCEEDED`` record: how many times the
    request's lease expired without an ack (``<q>:deliveries``, counted by the reclaimer)
    and the limit that made it a dead letter. ``lua/reclaim-6.lua`` builds the same text
    (a test checks that the two agree)."""
    times = "time" if expiries == 1 else "times"
    return f"lease expired {expiries} {times} without an ack (max_deliveries={max_deliveries})"


def _salvage(raw: bytes) -> tuple[str | None, str, str | None]:
    """Best effort id, request token and result list of a member that failed validation."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, "", None
    if not isinstance(doc, dict):
        return None, "", None
    data = doc.get("data")
    internal = doc.get("internal")
    rid = utf8_text(data.get("id")) if isinstance(data, dict) else None
    token = utf8_text(internal.get("request_token")) if isinstance(internal, dict) else None
    rq = utf8_text(internal.get("result_queue_name")) if isinstance(internal, dict) else None
    return rid or None, token or "", rq or None


def utf8_text(value: object) -> str | None:
    """``value`` if it is a string that can be written as UTF-8, else ``None``. JSON text may
    escape a lone surrogate (``"\\ud800"``), which ``json.loads`` accepts; no Redis key or
    record can carry it (writing one raised and took the whole consumer down)."""
    if not isinstance(value, str):
        return None
    try:
        value.encode()
    except UnicodeEncodeError:
        return None
    return value


def parse_member(raw: bytes) -> Envelope | Invalid:
    """Validate one pending member.

    Args:
        raw: the member bytes as read from the pending ZSET.

    Returns:
        An :class:`Envelope`, or an :class:`Invalid` whose ``reason`` names the bad field:
        :data:`DEADLINE_INVALID_MESSAGE` for a missing, non-integer or non-positive
        ``data.deadline``, :data:`DEADLINE_RANGE_MESSAGE` for one above
        :data:`MAX_DEADLINE`, else ``"Failed: invalid request: <msgspec's message, which
        ends with the JSON path>"`` or ``"Failed: request is not valid JSON: ..."``.
        Never raises. The producer (:class:`claimkit.Producer`) refuses a request whose
        member this would not return as an :class:`Envelope` (docs/protocol.md#producer).
    """
    try:
        wire = _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        rid, token, rq = _salvage(raw)
        text = str(exc)
        if text == f"Expected `int` <= {MAX_DEADLINE} - at `$.data.deadline`":
            reason = DEADLINE_RANGE_MESSAGE
        elif "$.data.deadline" in text or "`deadline`" in text:
            reason = DEADLINE_INVALID_MESSAGE
        else:
            reason = f"Failed: invalid request: {text}"
        return Invalid(raw, reason, rid, token, rq)
    except msgspec.DecodeError as exc:
        # Stricter than json.loads (a lone surrogate escape anywhere, say): the id may
        # still be readable, and then the request gets its INVALID_REQUEST record.
        rid, token, rq = _salvage(raw)
        return Invalid(raw, f"Failed: request is not valid JSON: {exc}", rid, token, rq)
    data, internal = wire.data, wire.internal
    ref = internal.payload_ref or None  # "" names no key, as upstream's omitempty writes it
    if ref is not None:
        problem = payload_ref_problem(data.id, internal.request_token or "", ref)
        if problem is not None:
            return Invalid(
                raw, problem, data.id, internal.request_token or "", internal.result_queue_name
            )
    return Envelope(
        raw=raw,
        id=data.id,
        deadline=data.deadline,
        request_kind=wire.request_kind,
        payload=data.payload,
        metadata=data.metadata or {},
        headers=data.headers or {},
        endpoint=data.endpoint,
        request_token=internal.request_token or "",
        retry_count=internal.retry_count,
        result_queue_name=internal.result_queue_name,
        last_response=_last_response(data.id, internal.claimkit_last_response),
        payload_ref=ref,
        enqueue_seq=_whole_number(internal.enqueue_seq),
        enqueued_at_ms=_whole_number(internal.enqueued_at_ms),
    )


def _whole_number(value: object) -> int | None:
    """``value`` as an ``int`` when it is a JSON number with no fraction (``3``, ``3.0``,
    ``3e0``), else ``None`` (a string, a boolean, ``2.5``, an object). The Lua side
    (``lua/_queue-score.lua``, ``whole_number``) reads the same values as whole: cjson
    gives it every number as a double, so a spelling cannot change the score."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def payload_ref_problem(request_id: str, request_token: str, ref: str) -> str | None:
    """Why a member's ``internal.payload_ref`` cannot be followed, else ``None``.

    claimkit reads and deletes the key a member names, so a member must not be able to
    name any key it likes (``"q:claimed"``, another request's payload): the one key it may
    name is its own, ``request-payload:<data.id>:<internal.request_token>``, the key
    llm-d-async's producer writes (docs/protocol.md#payload-references). The reason is the
    ``error_message`` of the member's ``INVALID_REQUEST`` record."""
    if not request_token:
        return "Failed: invalid request: internal.payload_ref needs an internal.request_token"
    expected = _keys.request_payload(request_id, request_token)
    if ref != expected:
        shown = ref if len(ref) <= 200 else ref[:200] + "..."
        return (
            f"Failed: invalid request: internal.payload_ref must be {expected} "
            f"(the key of this request's id and request_token), got {shown}"
        )
    return None


def payload_problem(value: bytes) -> str | None:
    """Why a fetched payload cannot be the HTTP body, else ``None``: it must be one JSON
    object or ``null`` (what a member may carry inline, docs/protocol.md#envelope). The
    reason is the ``error_message`` of the request's ``PAYLOAD_UNAVAILABLE`` record
    (:data:`PAYLOAD_NOT_JSON_MESSAGE`)."""
    try:
        msgspec.json.decode(value, type=msgspec.Raw)
    except msgspec.DecodeError:
        return PAYLOAD_NOT_JSON_MESSAGE
    head = value.lstrip(b" \t\r\n")[:1]
    if head == b"{" or head == b"n":  # n: a valid JSON value starting with n is null
        return None
    return PAYLOAD_NOT_JSON_MESSAGE


def _last_response(request_id: str, carried: object) -> TerminalRecord | None:
    """The record :data:`LAST_RESPONSE_FIELD` holds, or ``None`` when absent or damaged."""
    if not isinstance(carried, dict):
        return None
    status, payload = carried.get("status_code"), carried.get("payload")
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        return None
    if not isinstance(payload, str) or utf8_text(payload) is None:
        return None
    return TerminalRecord.http(request_id, status, payload)


def retry_member(raw: bytes, queue: str, last: TerminalRecord | None = None) -> bytes:
    """The retry-set copy of a member (docs/protocol.md): ``internal.retry_count`` + 1 and
    ``internal.request_queue_name`` = ``queue``; every other field, known or not, is kept.

    ``last``, the record of the attempt's HTTP response (status and body), is written to
    ``internal.claimkit_last_response`` (:data:`LAST_RESPONSE_FIELD`), the body cut at
    :data:`LAST_RESPONSE_MAX_BYTES`; with ``last=None`` (the attempt had no readable
    response) the copy keeps the one an earlier attempt left, if any.
    """
    doc = json.loads(raw)
    internal = doc.get("internal")
    if not isinstance(internal, dict):
        internal = doc["internal"] = {}
    count = internal.get("retry_count")
    internal["retry_count"] = (count if isinstance(count, int) else 0) + 1
    internal["request_queue_name"] = queue
    if last is not None and last.status_code is not None:
        body = last.payload.encode()[:LAST_RESPONSE_MAX_BYTES].decode("utf-8", errors="ignore")
        internal[LAST_RESPONSE_FIELD] = {"status_code": last.status_code, "payload": body}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def retry_queue_name(member: bytes) -> str | None:
    """The queue a retry-set member goes back to (its ``internal.request_queue_name``, set
    by :func:`retry_member`; ``lua/move-retries-2.lua`` reads the same field), or ``None``
    when the member is not JSON or names none (``""`` names none, as in the Lua). Never
    raises."""
    try:
        doc = json.loads(member)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    internal = doc.get("internal") if isinstance(doc, dict) else None
    queue = internal.get("request_queue_name") if isinstance(internal, dict) else None
    return queue if isinstance(queue, str) and queue else None


_GO_ESCAPES = (
    ("<", "\\u003c"),
    (">", "\\u003e"),
    ("&", "\\u0026"),
    ("\u2028", "\\u2028"),
    ("\u2029", "\\u2029"),
)
_SURROGATE = re.compile("[\ud800-\udfff]")


def go_json(value: object) -> str:
    """``value`` as compact JSON text, byte for byte as Go's ``encoding/json`` (``Marshal``)
    writes the same strings, maps and numbers: what llm-d-async writes
    (docs/protocol.md#terminal-record).

    Go escapes ``"``, ``\\``, the control characters (``\\n``, ``\\r``, ``\\t``, ``\\b``,
    ``\\f``, else ``\\u00xx``), the HTML characters ``<``, ``>``, ``&`` (``\\u003c``,
    ``\\u003e``, ``\\u0026``) and U+2028/U+2029 (``\\u2028``, ``\\u2029``); it writes every
    other character, DEL and non-ASCII included, as UTF-8. Python's
    ``json.dumps(ensure_ascii=False)`` does the first part; the rest is replaced here (none
    of those characters can appear in what ``json.dumps`` wrote as an escape). A lone
    surrogate, which no UTF-8 text holds, is written ``\\ufffd``, as Go writes a byte that
    is not UTF-8. ``lua/_record.lua`` writes the same bytes (a test compares them).
    """
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escape in _GO_ESCAPES:
        if char in text:
            text = text.replace(char, escape)
    if not text.isascii():
        text = _SURROGATE.sub(lambda _m: "\\ufffd", text)
    return text


@dataclass(frozen=True, slots=True)
class TerminalRecord:
    """One element of a result list (docs/protocol.md#terminal-record).

    ``payload`` is always a string: the raw HTTP body, or ``{"error":"<message>"}`` for a
    non-HTTP outcome. ``status_code`` is ``None`` when no HTTP response was had.
    ``request_token`` is the generation's ``internal.request_token``, ``None`` when the
    request had none (:meth:`for_generation` sets it as the record is acked).
    """

    id: str
    payload: str
    status_code: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    request_token: str | None = None

    @classmethod
    def http(
        cls, request_id: str, status_code: int, body: str, request_token: str | None = None
    ) -> TerminalRecord:
        """The record of an HTTP response: its status and exact body text."""
        return cls(
            id=request_id,
            payload=body,
            status_code=status_code,
            request_token=request_token or None,
        )

    @classmethod
    def error(
        cls, request_id: str, code: str, message: str, request_token: str | None = None
    ) -> TerminalRecord:
        """The record of a non-HTTP outcome: ``payload`` is ``{"error":"<message>"}`` as Go
        writes that map (:func:`go_json`)."""
        return cls(
            id=request_id,
            payload=go_json({"error": message}),
            error_code=code,
            error_message=message,
            request_token=request_token or None,
        )

    def for_generation(self, request_token: str) -> TerminalRecord:
        """This record carrying ``request_token`` (``""``: none), the generation it ends."""
        token = request_token or None
        if token == self.request_token:
            return self
        # Built directly: dataclasses.replace costs several times more, once per ack.
        return TerminalRecord(
            self.id, self.payload, self.status_code, self.error_code, self.error_message, token
        )

    def to_json(self) -> bytes:
        """Serialise as llm-d-async writes its result (``InternalResult``): ``id``,
        ``status_code`` (omitted when ``None``), ``payload``, ``error_code``,
        ``error_message`` (each omitted when ``None`` or empty), ``request_token`` last
        (omitted when ``None`` or empty), escaped as Go escapes (:func:`go_json`), so the
        bytes are Go's for the same record (docs/protocol.md#terminal-record)."""
        out: dict[str, Any] = {"id": self.id}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        out["payload"] = self.payload
        if self.error_code:
            out["error_code"] = self.error_code
        if self.error_message:
            out["error_message"] = self.error_message
        if self.request_token:
            out["request_token"] = self.request_token
        return go_json(out).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> TerminalRecord:
        """Parse a record read from a result list. Raises ``ValueError`` if it is not one.
        A ``request_token`` that is not a non-empty string reads as ``None``."""
        doc = json.loads(raw)
        if not isinstance(doc, dict) or not isinstance(doc.get("id"), str):
            raise ValueError("not a terminal record: no string `id`")
        token = doc.get("request_token")
        return cls(
            id=doc["id"],
            payload=str(doc.get("payload", "")),
            status_code=doc.get("status_code"),
            error_code=doc.get("error_code"),
            error_message=doc.get("error_message"),
            request_token=token if isinstance(token, str) and token else None,
        )
