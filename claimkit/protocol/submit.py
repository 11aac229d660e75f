"""Writing submitted requests (docs/protocol.md#producer): the submit scripts and the
cluster's ordered writes, and the member bytes they splice the enqueue order into
(docs/protocol.md#enqueue-order).

- standalone and sentinel: one call of ``lua/submit-1.lua`` for the whole batch, so it is
  written all or none;
- Redis Cluster (docs/topology.md#retries-cancellation-and-the-producer): the cancel
  markers deleted, then the active markers and payload keys set, each one pipelined round
  trip, then one ``lua/enqueue-2.lua`` call per deadline of the batch (its counter and the
  queue share the queue's slot), all in one pipeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from claimkit.protocol import keys as _keys
from claimkit.protocol.store_calls import as_int
from claimkit.store import reply_text
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from claimkit.store import Arg, ScriptCall, Store
    from claimkit.store.script_calls import ReplicaWait
    from claimkit.store.scripts import Script

__all__ = [
    "ENQUEUE_SEQ_FIELD",
    "ENQUEUE_SEQ_GRACE_SECONDS",
    "PAYLOAD_GRACE_MS",
    "CounterRefused",
    "MemberParts",
    "Submission",
    "compact_json",
    "member_parts",
    "write_submissions",
]

ENQUEUE_SEQ_FIELD = "enqueue_seq"
"""The ``internal`` field carrying a member's enqueue order (docs/protocol.md#enqueue-order)."""

ENQUEUE_SEQ_GRACE_SECONDS = 3600
"""A ``request-seq:<q>:<deadline>`` counter expires this long after its deadline, in
seconds (``EXPIREAT deadline + 3600``, as llm-d-async's producer sets it)."""

PAYLOAD_GRACE_MS = 600_000
"""A ``request-payload:<id>:<token>`` key expires this long after the request's deadline,
in milliseconds (10 minutes, as llm-d-async's producer sets it): time for the claim that
runs into its deadline to still read its payload."""

_PLACEHOLDER = b"-1"


@dataclass(frozen=True, slots=True)
class MemberParts:
    """A member's bytes around its ``internal.enqueue_seq`` value: the member is
    ``before + b"<seq>" + after`` (:meth:`with_seq`)."""

    before: bytes
    after: bytes

    def with_seq(self, seq: int) -> bytes:
        """The member carrying ``seq`` as its ``internal.enqueue_seq``."""
        return self.before + str(seq).encode() + self.after


def member_parts(doc: Mapping[str, Any]) -> MemberParts:
    """The compact JSON of the envelope ``doc`` (``internal`` first, as
    :func:`json.dumps` writes it with ``separators=(",", ":")`` and ``ensure_ascii=False``),
    cut where ``internal.enqueue_seq`` goes.

    ``doc["internal"]`` is written with ``enqueue_seq`` as its last key (any value it held
    is dropped), so the cut is found by construction, not by searching the text: a payload
    or an unknown field holding the text ``"enqueue_seq":-1`` cannot move it. The bytes
    with ``-1`` there are what llm-d-async's producer writes before its script replaces
    the placeholder.

    Raises:
        UnicodeEncodeError: a string holds a lone surrogate (``"\\ud800"``).
        TypeError, ValueError: ``doc`` holds a value JSON cannot write.
    """
    internal = {k: v for k, v in doc["internal"].items() if k != ENQUEUE_SEQ_FIELD}
    internal[ENQUEUE_SEQ_FIELD] = -1
    rest = {k: v for k, v in doc.items() if k != "internal"}
    inner = _dumps(internal)
    tail = b"" if not rest else b"," + _dumps(rest)[1:-1]
    cut = len(inner) - len(_PLACEHOLDER) - 1  # inner ends with the placeholder and "}"
    return MemberParts(b'{"internal":' + inner[:cut], b"}" + tail + b"}")


def compact_json(value: Any) -> bytes:
    """``value`` as claimkit writes JSON: compact, UTF-8, non-ASCII kept as it is.

    Raises:
        UnicodeEncodeError: a string holds a lone surrogate (``"\ud800"``).
        TypeError: ``value`` holds something JSON cannot write.
    """
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


_dumps = compact_json


@dataclass(frozen=True, slots=True)
class Submission:
    """One checked request, ready to be written.

    Attributes:
        id: ``data.id``.
        token: its new ``request_token`` (32 hex).
        deadline: ``data.deadline``, Unix seconds.
        parts: its member bytes around ``internal.enqueue_seq``.
        payload: with a payload reference, the payload's JSON text, stored at
            ``request-payload:<id>:<token>``; ``None`` when the payload is in the member.
    """

    id: str
    token: str
    deadline: int
    parts: MemberParts
    payload: bytes | None = None

    @property
    def active_expiry_ms(self) -> int:
        """When ``request-active:<id>`` expires: the deadline, Unix milliseconds."""
        return self.deadline * 1000

    @property
    def payload_expiry_ms(self) -> int:
        """When the payload key expires: the deadline plus :data:`PAYLOAD_GRACE_MS`, Unix
        milliseconds."""
        return self.deadline * 1000 + PAYLOAD_GRACE_MS

    @property
    def counter_expiry(self) -> int:
        """When the deadline's counter expires: the deadline plus
        :data:`ENQUEUE_SEQ_GRACE_SECONDS`, Unix seconds."""
        return self.deadline + ENQUEUE_SEQ_GRACE_SECONDS

    @property
    def payload_key(self) -> str | None:
        """``request-payload:<id>:<token>`` with a payload reference, else ``None``."""
        return None if self.payload is None else _keys.request_payload(self.id, self.token)


class CounterRefused(Exception):
    """A submit script found a ``request-seq`` counter it cannot count on (another type,
    or a string that is not a count) and wrote nothing.

    Attributes:
        index: the 0-based position of the first request that counts on it.
        problem: the script's words, naming the key (``"request-seq:q:1900000000 holds a
            hash, not a count"``).
    """

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(problem)
        self.index = index
        self.problem = problem


async def write_submissions(
    store: Store, queue: str, batch: Sequence[Submission], *, wait: ReplicaWait
) -> list[int]:
    """Write ``batch`` to ``queue`` (docs/protocol.md#producer); returns each request's
    ``internal.enqueue_seq``, in order.

    On a standalone or sentinel Redis one ``lua/submit-1.lua`` call writes every request,
    all or none. On a Redis Cluster (``store.mode == "cluster"``) the writes go in the
    safe order of docs/topology.md#retries-cancellation-and-the-producer: every ``DEL
    request-cancel:<id>``; then every ``SET request-active:<id>`` and payload key; then
    one ``lua/enqueue-2.lua`` call per deadline, all in one pipeline, each atomic. The
    queue comes last, so a request is never pending without its active marker and its
    payload.

    With ``wait.replicas`` above 0, the script calls are followed on their connection by
    ``WAIT`` (sent by ``EVAL``, so the one pipeline holds both); fewer replicas in time
    give a warning (:meth:`ReplicaWait.check`). Without, a store opened with its own
    ``wait_replicas`` follows them by its ``WAIT``.

    Raises:
        CounterRefused: a counter holds something else than a count; nothing was
            written (on a cluster: nothing queued for that deadline and after; the markers
            of those requests expire at their deadlines).
        StoreUnavailable, StoreError: from the store (``WRONGTYPE``: the queue key holds
            another type; nothing was written by that script call).

    Cancellation: one script call on a standalone Redis: written or not, as a whole. On a
    cluster a cancelled call may leave markers of requests it did not queue; they expire.
    """
    if not batch:
        return []
    if _keys.cluster_layout(store):
        return await _write_cluster(store, queue, batch, wait)
    args: list[Arg] = []
    for s in batch:
        payload_key = s.payload_key
        args += [
            _keys.request_seq(queue, s.deadline),
            s.counter_expiry,
            _keys.request_cancel(s.id),
            _keys.request_active(s.id),
            s.token,
            s.active_expiry_ms,
            payload_key or "",
            s.payload or b"",
            s.payload_expiry_ms if payload_key else "",
            s.parts.before,
            s.parts.after,
            s.deadline,
        ]
    (reply,) = await _run(store, script("submit"), [([queue], args)], wait)
    return _seqs(reply, list(range(len(batch))))


async def _write_cluster(
    store: Store, queue: str, batch: Sequence[Submission], wait: ReplicaWait
) -> list[int]:
    await store.pipeline([["DEL", _keys.request_cancel(s.id)] for s in batch], transaction=False)
    markers: list[list[Arg]] = []
    for s in batch:
        markers.append(["SET", _keys.request_active(s.id), s.token, "PXAT", s.active_expiry_ms])
        if s.payload is not None and s.payload_key is not None:
            markers.append(["SET", s.payload_key, s.payload, "PXAT", s.payload_expiry_ms])
    await store.pipeline(markers, transaction=False)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(batch):
        groups.setdefault(s.deadline, []).append(i)
    calls: list[ScriptCall] = []
    for deadline, indexes in groups.items():
        args: list[Arg] = [batch[indexes[0]].counter_expiry, deadline]
        for i in indexes:
            args += [batch[i].parts.before, batch[i].parts.after]
        calls.append(([queue, _keys.request_seq(queue, deadline, cluster=True)], args))
    replies = await _run(store, script("enqueue"), calls, wait)
    out = [0] * len(batch)
    refused: CounterRefused | None = None
    for indexes, reply in zip(groups.values(), replies, strict=True):
        try:
            for i, seq in zip(indexes, _seqs(reply, indexes), strict=True):
                out[i] = seq
        except CounterRefused as exc:
            refused = refused or exc
    if refused is not None:
        raise refused
    return out


def _seqs(reply: Any, indexes: Sequence[int]) -> list[int]:
    """The counts a submit script answered, or :class:`CounterRefused` (``{0, i, what}``,
    ``i`` 1-based among ``indexes``)."""
    if as_int(reply[0]) == 0:
        raise CounterRefused(indexes[as_int(reply[1]) - 1], reply_text(reply[2]))
    return [as_int(v) for v in reply[1:]]


async def _run(
    store: Store, called: Script, calls: Sequence[ScriptCall], wait: ReplicaWait
) -> list[Any]:
    """Run ``calls`` of ``called`` in one round trip; with ``wait.replicas``, by ``EVAL``
    and followed by ``WAIT`` in the same pipeline (one connection: ``WAIT`` covers them)."""
    if not wait.replicas:
        if len(calls) == 1:
            return [await store.run(called, *calls[0])]
        return await store.run_many(called, calls)
    commands: list[list[Arg]] = []
    for keys, args in calls:
        called.check_key_count(keys)
        commands.append(["EVAL", called.source, len(keys), *keys, *args])
    *replies, confirmed = await store.pipeline([*commands, list(wait.command())], transaction=False)
    wait.check("submit", confirmed)
    return replies
