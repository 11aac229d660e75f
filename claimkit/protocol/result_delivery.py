"""Durable result delivery: the reader's side of a result list (docs/results.md).

A reader receives a record under a lease (``lua/result-receive-5.lua``), renews the lease
while it works (``lua/result-renew-2.lua``) and acks it when done (``lua/result-ack-4.lua``),
which leaves a tombstone that drops later duplicates. A reader that dies leaves its records
leased; the next receive after the lease puts them back at the read end. The keys and
every entry written are llm-d-async's, so claimkit readers and llm-d-async readers (its
Batch Gateway) can share one list. Leases and tombstones are scored in Redis server-clock
milliseconds.

A destructive read (:func:`read_results` with ``pop``) refuses a list with durable-reader
state (``lua/result-pop-5.lua``, docs/results.md#never-mix-popping-and-durable-readers).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from claimkit.protocol import keys as _keys
from claimkit.protocol.models import TerminalRecord
from claimkit.protocol.tokens import new_token
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store import ScriptCall, Store

__all__ = [
    "DEFAULT_RESULT_LEASE_MS",
    "MAX_RESULT_LEASE_MS",
    "RESULT_BATCH",
    "UNPARSABLE_PREFIX",
    "ResultAckCode",
    "ResultClaims",
    "ResultDelivery",
    "ResultDeliveryError",
    "ResultListCounts",
    "ResultOwnershipLost",
    "ResultPopRefused",
    "check_lease_ms",
    "parse_result",
    "read_results",
    "unparsable_reason",
]

DEFAULT_RESULT_LEASE_MS = 300_000
"""A result lease unless the caller says otherwise: 5 minutes, in milliseconds
(llm-d-async's default; docs/results.md#lease-and-poll)."""

MAX_RESULT_LEASE_MS = 7 * 24 * 3600 * 1000
"""The longest result lease: 7 days, in milliseconds (docs/results.md#lease-and-poll). A
lease is added to the Redis server clock in milliseconds and stored as a sorted-set score;
far below 2^53, so the scripts hold it exactly, and as long as an acked record's tombstone
lives: a dead reader's records still come back within a week."""

RESULT_BATCH = 100
"""Per receive call: at most this many expired leases requeued, list elements scanned and
expired tombstones removed; per ack, expired tombstones removed (llm-d-async's batches)."""

UNPARSABLE_PREFIX = "\0unparsable-result\0"
"""An unparsable record's claim id is this plus the owner token of the receive that met it
(docs/results.md#unparsable-records)."""


def check_lease_ms(lease_ms: int) -> int:
    """``lease_ms`` when it is a lease the scripts take: a whole number of milliseconds from
    1 to :data:`MAX_RESULT_LEASE_MS` (7 days).

    Raises:
        ValueError: anything else (a float, ``inf``, 0, a negative, more than 7 days).
    """
    if isinstance(lease_ms, bool) or not isinstance(lease_ms, int):
        raise ValueError(f"lease_ms must be a whole number of milliseconds, got {lease_ms!r}")
    if not 1 <= lease_ms <= MAX_RESULT_LEASE_MS:
        raise ValueError(
            f"lease_ms must be from 1 to {MAX_RESULT_LEASE_MS} milliseconds (7 days), "
            f"got {lease_ms}"
        )
    return lease_ms


def parse_result(raw: bytes) -> tuple[TerminalRecord | None, str | None]:
    """What a result list's element ``raw`` is: ``(record, None)`` for a terminal record
    claimkit reads, else ``(None, why)`` (one line, :func:`unparsable_reason`). The one
    classification of listing (``claimkit results``) and of durable reading (a
    delivery's :attr:`ResultDelivery.unparsable`; docs/results.md#unparsable-records)."""
    try:
        return TerminalRecord.from_json(raw), None
    except (ValueError, TypeError, RecursionError):
        return None, unparsable_reason(raw)


class ResultDeliveryError(RuntimeError):
    """A durable result delivery call was refused (docs/results.md)."""


class ResultOwnershipLost(ResultDeliveryError):
    """The delivery is no longer this reader's: its lease expired (the record was, or will
    be, delivered again) or another owner holds it. Renewing or acking it is fenced off;
    drop the delivery (docs/results.md#renew, docs/results.md#ack).

    Attributes:
        delivery: the delivery that was refused.
    """

    def __init__(self, message: str, delivery: ResultDelivery) -> None:
        super().__init__(message)
        self.delivery = delivery


class ResultPopRefused(ResultDeliveryError):
    """A destructive pop of a result list that has durable-reader state (one of its four
    result-claim keys exists); nothing was popped
    (docs/results.md#never-mix-popping-and-durable-readers)."""


class ResultAckCode(enum.IntEnum):
    """Replies of the result ack script (``lua/result-ack-4.lua``, docs/results.md#ack)."""

    LOST = 0
    """Ownership lost: another owner holds it, or its lease expired."""
    ACKED = 1
    """Acked now: the claim is gone and a tombstone drops later duplicates for 7 days."""
    ALREADY_ACKED = 2
    """A live tombstone exists: acked before (a repeated ack is fine)."""


@dataclass(frozen=True, slots=True)
class ResultDelivery:
    """One record received under a lease (docs/results.md#receive).

    Attributes:
        raw: the record's exact bytes, as the publisher pushed them.
        record: the parsed :class:`TerminalRecord`, or ``None`` when the record is
            unparsable (:func:`parse_result` refuses it).
        claim_id: the claim's id in the result-claim keys: the record's ``id``, plus NUL and
            its ``request_token`` when that is a non-empty string; for a record the receive
            script could not read :data:`UNPARSABLE_PREFIX` + :attr:`owner` (a record it
            read but claimkit cannot, such as one that is not UTF-8, keeps the id the
            script gave it).
        owner: the owner token (fencing token) of the receive that claimed it.
        result_list: the list it came from.
        unparsable: ``None`` for a record, else why it cannot be read (one line). An
            unparsable record stays leased until acked; it is never deleted by a reader
            (docs/results.md#unparsable-records).
        request_token: the record's top-level ``request_token`` when it is a non-empty
            string, else ``None``; with :attr:`id` the dedup key (docs/results.md#dedup).
        id: the record's ``id`` (``None`` for an unparsable record).
    """

    raw: bytes
    record: TerminalRecord | None
    claim_id: str
    owner: str
    result_list: str
    unparsable: str | None = None
    request_token: str | None = None
    id: str | None = None

    @property
    def dedup_key(self) -> tuple[str, str | None] | None:
        """``(id, request_token)``: what a reader deduplicates by, the token ``None`` when
        the record has none; ``None`` for an unparsable record."""
        rid = self.id
        return None if rid is None else (rid, self.request_token)

    @classmethod
    def from_reply(
        cls, code: int, raw: bytes, claim_id: bytes | str, owner: str, result_list: str
    ) -> ResultDelivery:
        """A delivery from one triple of the receive script's reply (code 1: a record,
        -1: unparsable)."""
        cid = claim_id if isinstance(claim_id, str) else _text(claim_id)
        if code == -1:
            return cls(raw, None, cid, owner, result_list, unparsable=unparsable_reason(raw))
        # The script read it (Redis's JSON decoder does not check UTF-8); claimkit may not:
        # a record parse_result refuses is unparsable here too, under the claim id it got.
        record, why = parse_result(raw)
        if record is None:
            return cls(raw, None, cid, owner, result_list, unparsable=why)
        rid, token = _id_and_token(raw)
        return cls(raw, record, cid, owner, result_list, request_token=token, id=rid)


def _text(value: bytes) -> str:
    """Bytes from Redis as ``str``; bytes that are not UTF-8 survive the round trip back
    (``surrogateescape``)."""
    return value.decode("utf-8", "surrogateescape")


def _wire(value: str) -> bytes:
    return value.encode("utf-8", "surrogateescape")


def _id_and_token(raw: bytes) -> tuple[str | None, str | None]:
    """The record's ``id`` and non-empty top-level ``request_token``, read from its JSON."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(doc, dict):
        return None, None
    rid, token = doc.get("id"), doc.get("request_token")
    return (
        rid if isinstance(rid, str) else None,
        token if isinstance(token, str) and token else None,
    )


def unparsable_reason(raw: bytes) -> str:
    """Why the receive script could not read ``raw`` as a result (one line): what its claim
    id rule needs is a JSON object with a non-empty string ``id`` and, when present, a
    string ``request_token`` (docs/results.md#unparsable-records)."""
    try:
        doc = json.loads(raw)
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except RecursionError:
        return "JSON nested too deeply"
    except ValueError as exc:
        return f"not JSON ({exc})"
    if not isinstance(doc, dict):
        return f"JSON {_kind(doc)}, not an object"
    rid = doc.get("id")
    if "id" not in doc:
        return "no `id` field"
    if not isinstance(rid, str):
        return f"`id` is {_kind(rid)}, not a string"
    if not rid:
        return "`id` is empty"
    token = doc.get("request_token")
    if "request_token" in doc and not isinstance(token, str):
        return f"`request_token` is {_kind(token)}, not a string"
    return "Redis's JSON decoder refused it"


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


@dataclass(frozen=True, slots=True)
class ResultListCounts:
    """A result list's durable-reader state in one instant (``lua/result-inspect-3.lua``).

    Attributes:
        pending: records in the list (not yet received).
        leased: claims in the lease index (received, not acked).
        expired: of those, how many are past their lease (they go back at the next receive).
        tombstones: live tombstones (acked records whose duplicates are dropped).
    """

    pending: int
    leased: int
    expired: int
    tombstones: int


class ResultClaims:
    """The durable-reader scripts of one result list ``result_list`` on ``store``, in the key
    layout of the store's mode (:func:`~claimkit.protocol.keys.cluster_layout`).

    Raises:
        ValueError: on a Redis Cluster, ``result_list`` is a name whose keys cannot share its
            slot (:func:`~claimkit.protocol.keys.cluster_name_problem`).
    """

    def __init__(self, store: Store, result_list: str) -> None:
        self.store = store
        self.result_list = result_list
        self.keys = _keys.ResultClaimKeys.for_list(result_list, cluster=_keys.cluster_layout(store))

    async def receive(
        self, count: int = 1, *, lease_ms: int = DEFAULT_RESULT_LEASE_MS
    ) -> list[ResultDelivery]:
        """Claim up to ``count`` records, oldest first, each under a lease of ``lease_ms``
        milliseconds (server clock), all under one fresh owner token
        (docs/results.md#receive). Expired leases are requeued first, so a dead reader's
        records come back here. Duplicates of an acked or leased generation are dropped on
        the way; a call that met only duplicates is repeated at once. Fewer than ``count``
        (none: ``[]``) when the list has no more, or after an unparsable record (one per
        call, returned with the others).

        Raises:
            ValueError: ``count`` below 1, or ``lease_ms`` not a whole number of
                milliseconds from 1 to :data:`MAX_RESULT_LEASE_MS` (nothing is sent).
            StoreError: ``WRONGTYPE`` (one of the five keys holds another type; nothing
                written), or another Redis error; StoreUnavailable: Redis unreachable.

        Cancellation: a call cancelled after Redis ran the script leaves its records
        leased under a token this reader never learned: they come back after the lease.
        """
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        check_lease_ms(lease_ms)
        k = self.keys
        while True:
            owner = new_token()
            reply = await self.store.run(
                script("result-receive"),
                k.all(),
                [owner, lease_ms, RESULT_BATCH, max(RESULT_BATCH, count), RESULT_BATCH, count],
            )
            reply = list(reply or [])
            if reply and int(reply[0]) == 0 and len(reply) == 1:
                continue  # only duplicates dropped, and more records wait
            return [
                ResultDelivery.from_reply(
                    int(reply[i]), bytes(reply[i + 1]), reply[i + 2], owner, self.result_list
                )
                for i in range(0, len(reply) - 2, 3)
            ]

    async def renew(
        self, deliveries: Sequence[ResultDelivery], *, lease_ms: int = DEFAULT_RESULT_LEASE_MS
    ) -> list[bool]:
        """Extend the lease of each delivery to server now + ``lease_ms`` milliseconds, fenced
        by its owner token; all in one round trip (one script call each, pipelined;
        docs/results.md#renew). Returns, per delivery, whether it is still this reader's
        (``False``: ownership lost, the lease expired or another owner holds it).

        Raises:
            ValueError: ``lease_ms`` out of range (:func:`check_lease_ms`; nothing sent).
            StoreError, StoreUnavailable: from the store (a lost reply may have renewed
            some).

        Cancellation: each call renews or not; nothing is lost either way.
        """
        check_lease_ms(lease_ms)
        if not deliveries:
            return []
        k = self.keys
        calls: list[ScriptCall] = [
            ([k.owners, k.index], [_wire(d.claim_id), d.owner, lease_ms]) for d in deliveries
        ]
        replies = await self.store.run_many(script("result-renew"), calls)
        return [int(r) == 1 for r in replies]

    async def ack(self, delivery: ResultDelivery) -> ResultAckCode:
        """Ack one delivery, fenced by its owner token (docs/results.md#ack): its claim is
        deleted and a tombstone drops duplicates of it for 7 days
        (:data:`~claimkit.protocol.keys.RESULT_TOMBSTONE_TTL_MS`).

        Raises:
            StoreError, StoreUnavailable: from the store.

        Cancellation: an ack whose reply was lost may have acked; acking again returns
        :attr:`ResultAckCode.ALREADY_ACKED`.
        """
        k = self.keys
        reply = await self.store.run(
            script("result-ack"),
            [k.claimed, k.owners, k.index, k.tombstones],
            [_wire(delivery.claim_id), delivery.owner, _keys.RESULT_TOMBSTONE_TTL_MS, RESULT_BATCH],
        )
        return ResultAckCode(int(reply))

    async def counts(self) -> ResultListCounts:
        """The list's pending records, leases (and how many expired) and live tombstones, in
        one instant (a read-only script). Raises StoreError, StoreUnavailable."""
        k = self.keys
        reply = await self.store.run(
            script("result-inspect"), [k.results, k.index, k.tombstones], []
        )
        pending, leased, expired, tombstones = (int(v) for v in reply)
        return ResultListCounts(pending, leased, expired, tombstones)

    async def pop(self, count: int) -> list[bytes]:
        """Remove and return up to ``count`` records, oldest first, unless the list has
        durable-reader state.

        Raises:
            ResultPopRefused: one of the four result-claim keys exists; nothing popped.
            StoreError, StoreUnavailable: from the store.

        Cancellation: a pop whose reply was lost removed its records: only for a caller
        that is the list's one consumer and accepts that (docs/results.md).
        """
        reply: list[Any] = list(
            await self.store.run(script("result-pop"), self.keys.all(), [count]) or []
        )
        if int(reply[0]) == 0:
            raise ResultPopRefused(
                f"{self.result_list} has durable readers (one of "
                f"{', '.join(self.keys.reader_state())} exists): a pop would take records "
                "they count on; read it with --follow (durable) or without --pop "
                "(docs/results.md#never-mix-popping-and-durable-readers)"
            )
        return [bytes(r) for r in reply[1:]]


async def read_results(store: Store, name: str, *, count: int, pop: bool) -> list[bytes]:
    """The oldest ``count`` records of the list ``name``, oldest first.

    Without ``pop`` they stay (``LRANGE``); with it they are removed (``RPOP`` in
    ``lua/result-pop-5.lua``), refused while the list has durable readers. An empty or
    missing list gives ``[]``.

    Raises:
        ResultPopRefused: with ``pop``, the list has durable-reader state; nothing popped.
        StoreError: a ``WRONGTYPE`` reply, or any other Redis error;
            :class:`~claimkit.store.StoreUnavailable` when Redis cannot be reached.

    Cancellation: one round trip; a cancelled pop whose reply was lost has removed its
    records (durable reading, :class:`ResultClaims`, loses nothing).
    """
    if pop:
        return await ResultClaims(store, name).pop(count)
    return list(reversed(await store.command("LRANGE", name, -count, -1)))
