"""The producer side (docs/protocol.md#producer): submit, cancel and read results, durably
too (docs/results.md)."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from claimkit.protocol import keys as _keys
from claimkit.protocol.models import (
    MAX_DEADLINE,
    Invalid,
    TerminalRecord,
    deadline_passed,
    parse_member,
)
from claimkit.protocol.result_delivery import (
    DEFAULT_RESULT_LEASE_MS,
    ResultAckCode,
    ResultClaims,
    ResultDelivery,
    ResultOwnershipLost,
    read_results,
)
from claimkit.protocol.submit import (
    ENQUEUE_SEQ_FIELD,
    CounterRefused,
    MemberParts,
    Submission,
    compact_json,
    member_parts,
    write_submissions,
)
from claimkit.result_reader import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_POLL_SECONDS,
    ResultReader,
    open_result_reader,
)
from claimkit.store import reply_text
from claimkit.store.script_calls import ReplicaWait

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractAsyncContextManager

    from claimkit.store import Store

__all__ = ["CANCEL_TTL_SECONDS", "INVALID_PAYLOAD_MESSAGE", "Producer", "SubmitError"]

CANCEL_TTL_SECONDS = 604800  # 7 days (docs/protocol.md#keys, request-cancel:<id>)

INVALID_PAYLOAD_MESSAGE = "invalid payload: must be a JSON object or null"
"""The refusal of a request whose ``data.payload`` is not a JSON object or ``null``
(llm-d-async's producer's words; docs/protocol.md#producer)."""

PAYLOAD_REF_FIELD = "payload_ref"
"""The ``internal`` field naming a request's payload key (docs/protocol.md#payload-references)."""


class SubmitError(ValueError):
    """A producer call was refused before anything was written (docs/protocol.md#producer).

    ``str(err)`` is one line saying what is wrong: one of the producer's messages ("request
    ID is required", "deadline is required", "deadline has already expired";
    docs/protocol.md#producer), a more precise one about ``deadline`` or the request's
    shape, or the consumer's own parser's reason (:func:`claimkit.protocol.models.parse_member`,
    without its ``"Failed: "``), which names the field by its JSON path.

    Attributes:
        index: the 0-based position, in the input of :meth:`Producer.submit_many`, of the
            request that was refused; ``None`` when the refusal is not about one request
            (the queue key or a cancel key holds another Redis type).
    """

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def _json_kind(value: object) -> str:
    """What a JSON value decoded by :func:`json.loads` was, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fraction or exponent"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _msgspec_kind(value: object) -> str:
    """msgspec's name for the JSON type of ``value``, as in its ``Expected ..., got `x```."""
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__


def _server_now(reply: Any) -> float:
    return int(reply[0]) + int(reply[1]) / 1_000_000


class Producer:
    """Puts requests on a queue and reads their terminal records.

    Args:
        store: an open :class:`~claimkit.store.Store`.
        queue: the pending ZSET ``<q>``.
        result_list: the list :meth:`results` reads (default ``result-list``); on a Redis
            Cluster also the list whose dedup markers :meth:`cancel` consults.
        payload_refs: submit with payload references (docs/protocol.md#payload-references):
            each request's ``data.payload`` is stored apart, at
            ``request-payload:<id>:<token>`` (expiring 10 minutes after the deadline), and
            its pending member carries ``"payload":null`` and that key's name in
            ``internal.payload_ref``, so the queue stays small. The consumer must read
            payload references (llm-d-async's newest dispatcher does). Off by default:
            the payload travels in the member.
        wait_replicas, wait_timeout_ms: see :attr:`wait`.
    """

    def __init__(
        self,
        store: Store,
        queue: str,
        *,
        result_list: str = _keys.DEFAULT_RESULT_LIST,
        payload_refs: bool = False,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.store = store
        self.queue = queue
        self.result_list = result_list
        self.payload_refs = payload_refs
        self.wait = ReplicaWait(wait_replicas, wait_timeout_ms or 1000, store.url)
        """``wait_replicas`` (0: off) and ``wait_timeout_ms`` (milliseconds): with replicas
        to wait for, :meth:`submit_many` sends ``WAIT`` after the script call that queues
        its requests, on the same connection (docs/topology.md#failover)."""
        self.cluster = _keys.cluster_layout(store)
        """Whether ``store`` is a Redis Cluster (``store.mode == "cluster"``): then no call
        wraps keys of several slots in one MULTI
        (docs/topology.md#retries-cancellation-and-the-producer)."""

    @staticmethod
    def envelope(request: Mapping[str, Any], token: str) -> dict[str, Any]:
        """The envelope for ``request``: either a whole envelope (it has ``data``) or just its
        ``data`` object. ``internal.request_token`` is set to ``token``; every other field is
        kept as given.

        Raises:
            SubmitError: ``request`` is not a JSON object, or its ``internal`` is present and
                neither an object nor null.
        """
        if not isinstance(request, Mapping):
            raise SubmitError(
                "a request must be a JSON object (a data object or an envelope), "
                f"got {_json_kind(request)}"
            )
        if "data" in request:
            doc = dict(request)
            internal = doc.pop("internal", None)
            if internal is None:
                internal = {}
            elif not isinstance(internal, Mapping):
                # Worded as parse_member words it, so both sides name the field alike.
                raise SubmitError(
                    f"invalid request: Expected `object`, got `{_msgspec_kind(internal)}` - "
                    "at `$.internal`"
                )
            internal = dict(internal)
        else:
            doc = {"request_kind": "plain", "data": dict(request)}
            internal = {}
        internal["request_token"] = token
        return {"internal": internal, "request_kind": doc.pop("request_kind", "plain"), **doc}

    @staticmethod
    def _check(data: Mapping[str, Any], now: float) -> tuple[str, int]:
        """The producer's checks of ``data`` (docs/protocol.md#producer), with its messages,
        and the deadline's type and range (:data:`~claimkit.protocol.models.MAX_DEADLINE`)
        said precisely."""
        rid = data.get("id")
        if not isinstance(rid, str) or not rid:
            raise SubmitError("request ID is required")
        deadline = data.get("deadline")
        if deadline is None:
            raise SubmitError("deadline is required")
        if isinstance(deadline, bool) or not isinstance(deadline, int):
            raise SubmitError(
                f"deadline must be an integer number of Unix seconds, got {_json_kind(deadline)}"
            )
        if deadline <= 0:
            raise SubmitError("deadline is required")
        if deadline > MAX_DEADLINE:
            raise SubmitError(
                f"deadline is out of range: at most {MAX_DEADLINE} Unix seconds "
                f"(9999-12-31T23:59:59Z), got {deadline}"
            )
        if deadline_passed(deadline, now):
            raise SubmitError("deadline has already expired")
        return rid, deadline

    def _submission(self, request: Mapping[str, Any], token: str, now: float) -> Submission:
        """``request`` checked and ready to be written: its member bytes (around
        ``internal.enqueue_seq``), checked by the consumer's own parser, and with
        :attr:`payload_refs` its payload apart. Raises :class:`SubmitError` (``index``
        unset)."""
        doc = self.envelope(request, token)
        data = doc.get("data")
        if isinstance(data, Mapping):  # else parse_member names `$.data` below
            self._check(data, now)
            payload = data.get("payload")
            if payload is not None and not isinstance(payload, Mapping):
                raise SubmitError(INVALID_PAYLOAD_MESSAGE)
        if PAYLOAD_REF_FIELD in doc["internal"]:
            raise SubmitError(
                "internal.payload_ref is the producer's to set: give the payload in "
                "data.payload (docs/protocol.md#payload-references)"
            )
        parts = self._parts(doc)
        parsed = parse_member(parts.with_seq(1))
        if isinstance(parsed, Invalid):
            raise SubmitError(parsed.reason.removeprefix("Failed: "))
        if not self.payload_refs or not isinstance(data, Mapping):
            return Submission(parsed.id, token, parsed.deadline, parts)
        ref = _keys.request_payload(parsed.id, token)
        payload_text = compact_json(data.get("payload"))
        parts = self._parts(_with_payload_ref(doc, ref))
        return Submission(parsed.id, token, parsed.deadline, parts, payload_text)

    @staticmethod
    def _parts(doc: Mapping[str, Any]) -> MemberParts:
        try:
            return member_parts(doc)
        except UnicodeEncodeError:
            # json.loads accepts an escaped lone surrogate ("\ud800"); UTF-8 cannot carry it.
            raise SubmitError(
                "request holds a string with a lone surrogate escape (such as \\ud800), "
                "which is not valid Unicode"
            ) from None

    async def submit_many(self, requests: Iterable[Mapping[str, Any]]) -> list[str]:
        """Submit requests in submission order, atomically, all or none
        (docs/protocol.md#producer).

        Each request is an envelope (it has ``data``) or a bare ``data`` object, with
        ``id`` (non-empty string) and ``deadline`` (JSON integer, Unix seconds, in the
        future by the Redis server clock, at most
        :data:`~claimkit.protocol.models.MAX_DEADLINE`), and a ``data.payload`` that is a
        JSON object or absent or null (:data:`INVALID_PAYLOAD_MESSAGE`). Every request is
        checked before anything is written: its exact member bytes must pass the consumer's
        parser (:func:`~claimkit.protocol.models.parse_member`), so nothing submitted is
        later dead-lettered as malformed. A given ``internal.enqueue_seq`` is replaced; a
        given ``internal.payload_ref`` is refused.

        One script call (``lua/submit-1.lua``) writes them all: per request ``DEL
        request-cancel:<id>``, ``SET request-active:<id> <token> PXAT <deadline ms>``
        (with :attr:`payload_refs`, ``SET request-payload:<id>:<token> <payload> PXAT
        <deadline ms + 10 min>``), ``INCR request-seq:<q>:<deadline>`` (``EXPIREAT`` the
        deadline + 1 hour) and ``ZADD <q>`` of the member carrying that count as
        ``internal.enqueue_seq``, at ``deadline + min(seq, 2^21 - 1) / 2^21``
        (docs/protocol.md#enqueue-order). Requests of one deadline are then served in the
        order they were submitted.

        On a Redis Cluster those keys live in different slots and no script may span them
        (docs/topology.md#retries-cancellation-and-the-producer): the writes go in three
        round trips in a safe order, every ``DEL request-cancel:<id>``, then every ``SET
        request-active:<id>`` and payload key, then one ``lua/enqueue-2.lua`` call per
        deadline (counter and queue share the queue's slot), all in one pipeline (the queue
        last: a request is never pending without its active marker and its payload). A
        call that fails part-way may leave active markers and payloads of requests never
        queued, which expire after their deadlines.

        Returns:
            The generated ``request_token`` (32 hex characters) of each request, in order.
            An empty input writes nothing and returns ``[]``.

        Raises:
            SubmitError: a request is invalid (its position in ``index``), the queue key
                holds another Redis type or is named like a per-request key
                (``request-active:…``), or a ``request-seq`` counter holds something else
                than a count (a hand edit; ``index``: the first request counting on it);
                nothing was written (on a cluster, a bad counter leaves the requests of the
                other deadlines queued).
            StorePermissionError: the Redis user may not run ``EVALSHA`` or one of the
                commands or keys.
            StoreUnavailable, StoreError: from the store.

        Cancellation: on a standalone Redis the one script call is written whole or not at
        all; on a cluster a cancelled call may leave markers of requests it never queued.
        """
        if _keys.is_reserved(self.queue, frozenset()):
            raise SubmitError(
                f"queue name {self.queue!r} is the name of a per-request key "
                "(docs/protocol.md#keys): choose another"
            )
        now_reply, kind = await self.store.pipeline(
            [["TIME"], ["TYPE", self.queue]], transaction=False
        )
        now = _server_now(now_reply)
        kind = reply_text(kind)
        if kind not in (_keys.PENDING_TYPE, "none"):
            # Said here in one line; the script's own check (WRONGTYPE) covers a race.
            raise SubmitError(f"queue key {self.queue!r} holds a {kind}, not a sorted set")
        batch: list[Submission] = []
        for index, request in enumerate(requests):
            token = secrets.token_hex(16)
            try:
                batch.append(self._submission(request, token, now))
            except SubmitError as exc:
                raise SubmitError(str(exc), index=index) from None
        if not batch:
            return []
        try:
            await write_submissions(self.store, self.queue, batch, wait=self.wait)
        except CounterRefused as exc:
            raise SubmitError(
                f"{exc.problem}: the queue's enqueue-order counter "
                "(docs/protocol.md#enqueue-order); delete it to submit again",
                index=exc.index,
            ) from None
        return [s.token for s in batch]

    async def submit(self, request: Mapping[str, Any]) -> str:
        """Submit one request; see :meth:`submit_many`. Returns its ``request_token``."""
        return (await self.submit_many([request]))[0]

    async def cancel(self, request_id: str) -> bool:
        """Cancel a request (docs/protocol.md#producer): if ``request-active:<id>`` holds
        the token of a live generation, copy it to ``request-cancel:<id>`` with a 7-day TTL
        (:data:`CANCEL_TTL_SECONDS`). The consumer then ends it with a ``CANCELLED`` record
        when it next claims it; a request already being run is not interrupted.

        A generation whose terminal record was already pushed (``result-terminal:<id>``
        holds its token, docs/protocol.md#keys; on a Redis Cluster, the marker of
        :attr:`result_list`) is finished: nothing is written. So is an
        unknown id or one past its deadline (``request-active:<id>`` has expired).

        Returns:
            Whether a live generation was found and the cancel marker set.

        Raises:
            SubmitError: ``request-active:<id>``, ``request-cancel:<id>`` or
                ``result-terminal:<id>`` holds another Redis type than a string (on a
                cluster: the list's marker hash or expiry set another type than a hash or a
                sorted set; one line naming the key); nothing was written.
            StoreUnavailable, StoreError: from the store.
        """
        active = _keys.request_active(request_id)
        cancel = _keys.request_cancel(request_id)
        if self.cluster:
            return await self._cancel_cluster(request_id, active, cancel)
        terminal = _keys.result_terminal(request_id)
        names = (active, cancel, terminal)
        kinds = await self.store.pipeline([["TYPE", k] for k in names], transaction=True)
        self._check_kinds(request_id, dict(zip(names, ["string"] * 3, strict=True)), kinds)
        token, finished = await self.store.pipeline(
            [["GET", active], ["GET", terminal]], transaction=True
        )
        if token is None or token == finished:
            return False
        await self.store.command("SET", cancel, token, "EX", CANCEL_TTL_SECONDS)
        return True

    @staticmethod
    def _check_kinds(request_id: str, expected: dict[str, str], kinds: list[Any]) -> None:
        for (name, want), reply in zip(expected.items(), kinds, strict=True):
            kind = reply_text(reply)
            if kind not in (want, "none"):
                raise SubmitError(
                    f"key {name!r} holds {_keys.type_name(kind)}, not {_keys.type_name(want)}: "
                    f"{request_id!r} was not cancelled"
                )

    async def _cancel_cluster(self, request_id: str, active: str, cancel: str) -> bool:
        """:meth:`cancel` on a Redis Cluster: the same checks, as pipelines without MULTI
        (the keys live in several slots). The record's marker is read from
        :attr:`result_list`'s marker hash (docs/topology.md#dedup-markers-per-destination),
        with its expiry, on the server clock."""
        markers = _keys.ResultKeys.for_list(self.result_list)
        expected = {
            active: "string",
            cancel: "string",
            markers.terminal: "hash",
            markers.expiry: "zset",
        }
        kinds = await self.store.pipeline([["TYPE", k] for k in expected], transaction=False)
        self._check_kinds(request_id, expected, kinds)
        token, finished, expiry, now = await self.store.pipeline(
            [
                ["GET", active],
                ["HGET", markers.terminal, request_id],
                ["ZSCORE", markers.expiry, request_id],
                ["TIME"],
            ],
            transaction=False,
        )
        if expiry is not None and float(expiry) <= _server_now(now):
            finished = None  # an expired marker is no marker
        if token is None or token == finished:
            return False
        await self.store.command("SET", cancel, token, "EX", CANCEL_TTL_SECONDS)
        return True

    async def results(self, count: int = 100, *, pop: bool = False) -> list[TerminalRecord | bytes]:
        """Up to ``count`` records of the result list, oldest first.

        Reading never removes unless asked: by default the records stay in the list
        (``LRANGE``); ``pop=True`` removes what it returns (``RPOP``), for a caller that is
        the list's only consumer, and is refused while the list has durable readers
        (docs/results.md#never-mix-popping-and-durable-readers). Durable reading, which
        loses nothing, is :meth:`receive_results` / :meth:`result_reader`. Every element
        read is returned, in list order: a :class:`TerminalRecord` when it is one, else its
        exact bytes (an element that is not valid JSON or has no string ``id``, written by
        someone else). A popped element is never dropped, so the caller decides where an
        unreadable one goes.

        Returns:
            ``TerminalRecord`` or ``bytes`` per element; ``[]`` when the list is empty.

        Raises:
            ResultPopRefused: with ``pop=True``, one of the list's four result-claim keys
                exists (docs/results.md#keys); nothing was popped.
            StoreUnavailable, StoreError: from the store. With ``pop=True``, a pop whose
                reply was lost (a broken connection) may have removed records.

        Cancellation: with ``pop=True``, a call cancelled after Redis ran the pop loses
        what it popped, as a lost reply does; a read without ``pop`` loses nothing.
        """
        raw = await read_results(self.store, self.result_list, count=count, pop=pop)
        return [_record_or_raw(r) for r in raw]

    def _result_claims(self) -> ResultClaims:
        return ResultClaims(self.store, self.result_list)

    async def receive_results(
        self, count: int = 1, *, lease_ms: int = DEFAULT_RESULT_LEASE_MS
    ) -> list[ResultDelivery]:
        """Claim up to ``count`` records of :attr:`result_list`, oldest first, each under a
        lease of ``lease_ms`` **milliseconds** on the Redis server clock (default 5
        minutes; docs/results.md#receive). Nothing is removed for good until
        :meth:`ack_result`: a record whose lease runs out (its reader died, or did not
        renew) goes back to the read end and is delivered again, to any reader, llm-d's
        Batch Gateway included. Duplicates of a record already acked or leased are dropped
        on the way. An unparsable record is returned too (``unparsable`` says why); it
        stays leased until acked and is never deleted.

        Returns:
            The deliveries, fewer than ``count`` (``[]``: none) when no more wait.

        Raises:
            ValueError: ``count`` below 1; ``lease_ms`` not a whole number of milliseconds
                from 1 to 604,800,000 (7 days); on a Redis Cluster, a list name whose keys
                cannot share its slot (nothing is sent).
            StoreError: one of the list's keys holds another Redis type (nothing written).
            StoreUnavailable: Redis unreachable.

        Cancellation: records claimed by a call whose reply was lost stay leased and come
        back after ``lease_ms``.
        """
        return await self._result_claims().receive(count, lease_ms=lease_ms)

    async def renew_result(
        self, delivery: ResultDelivery, *, lease_ms: int = DEFAULT_RESULT_LEASE_MS
    ) -> None:
        """Extend ``delivery``'s lease to server now + ``lease_ms`` **milliseconds**, fenced
        by its owner token (docs/results.md#renew). An expired lease is never revived.

        Raises:
            ResultOwnershipLost: the lease expired or another owner holds the record.
            ValueError: ``lease_ms`` not a whole number of milliseconds from 1 to
                604,800,000 (7 days). StoreError, StoreUnavailable: from the store.

        Cancellation: renews or not; nothing is lost either way.
        """
        (renewed,) = await self._result_claims().renew([delivery], lease_ms=lease_ms)
        if not renewed:
            raise ResultOwnershipLost(
                f"result {delivery.claim_id!r} of {delivery.result_list} is no longer this "
                "reader's (its lease expired or another reader holds it): not renewed "
                "(docs/results.md#renew)",
                delivery,
            )

    async def ack_result(self, delivery: ResultDelivery) -> ResultAckCode:
        """Ack ``delivery``, fenced by its owner token: its claim is deleted and a tombstone
        drops later duplicates of the same ``(id, request_token)`` for 7 days
        (docs/results.md#ack).

        Returns:
            ``ResultAckCode.ACKED``, or ``ResultAckCode.ALREADY_ACKED`` for a repeated ack.

        Raises:
            ResultOwnershipLost: the lease expired or another owner holds the record: it
                was, or will be, delivered again.
            StoreError, StoreUnavailable: from the store.

        Cancellation: an ack whose reply was lost may have acked; acking again then
        returns ``ALREADY_ACKED``.
        """
        code = await self._result_claims().ack(delivery)
        if code is ResultAckCode.LOST:
            raise ResultOwnershipLost(
                f"result {delivery.claim_id!r} of {delivery.result_list} is no longer this "
                "reader's (its lease expired or another reader holds it): not acked; it is "
                "delivered again (docs/results.md#ack)",
                delivery,
            )
        return code

    def result_reader(
        self,
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        poll_seconds: float = DEFAULT_POLL_SECONDS,
        batch: int = 1,
        on_renew_error: Callable[[BaseException], None] | None = None,
    ) -> AbstractAsyncContextManager[ResultReader]:
        """A durable reader of :attr:`result_list` (docs/results.md#the-reader)::

            async with producer.result_reader(lease_seconds=60) as reader:
                async for delivery in reader:
                    ...
                    await reader.ack(delivery)

        Every delivery handed out and not yet acked (or :meth:`ResultReader.forget`-ten) is
        renewed in the background, every ``lease_seconds / 3``, all in one round trip.

        Args:
            lease_seconds: the lease, **seconds** (0.001 to 604800, 7 days; default 300).
            poll_seconds: seconds between receives while the list is empty (above 0, at
                most 3600; default 1).
            batch: records claimed per receive (default 1).
            on_renew_error: called when a renewal tick cannot reach Redis (then retried).

        Raises:
            ValueError: an argument out of range (``inf``, ``nan``, 0, a negative, a lease
                over 7 days), with a message naming it; nothing is sent.

        Cancellation: leaving the block stops the renewals; deliveries not acked stay
        leased and come back after their lease.
        """
        return open_result_reader(
            self.store,
            self.result_list,
            lease_seconds=lease_seconds,
            poll_seconds=poll_seconds,
            batch=batch,
            on_renew_error=on_renew_error,
        )


def _record_or_raw(raw: bytes) -> TerminalRecord | bytes:
    """``raw`` as a record, or ``raw`` itself when it is not one (never raises)."""
    try:
        return TerminalRecord.from_json(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return raw


def _with_payload_ref(doc: Mapping[str, Any], ref: str) -> dict[str, Any]:
    """``doc`` with its payload apart: ``data.payload`` null and ``internal.payload_ref`` =
    ``ref``, placed after ``internal.result_queue_name`` (llm-d-async's order), else last
    before ``internal.enqueue_seq`` (which :func:`member_parts` puts last)."""
    internal: dict[str, Any] = {}
    for name, value in doc["internal"].items():
        if name != ENQUEUE_SEQ_FIELD:
            internal[name] = value
        if name == "result_queue_name":
            internal[PAYLOAD_REF_FIELD] = ref
    internal.setdefault(PAYLOAD_REF_FIELD, ref)
    data = dict(doc["data"])
    data["payload"] = None
    return {**doc, "internal": internal, "data": data}
