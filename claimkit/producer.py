"""The producer side (docs/protocol.md#producer): submit, cancel and read results, durably
too (docs/results.md)."""

from __future__ import annotations

import json
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

    from claimkit.store import Arg, Store

__all__ = ["CANCEL_TTL_SECONDS", "Producer", "SubmitError"]

CANCEL_TTL_SECONDS = 604800  # 7 days (docs/protocol.md#keys, request-cancel:<id>)


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
    """

    def __init__(
        self,
        store: Store,
        queue: str,
        *,
        result_list: str = _keys.DEFAULT_RESULT_LIST,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.store = store
        self.queue = queue
        self.result_list = result_list
        self.wait = ReplicaWait(wait_replicas, wait_timeout_ms or 1000, store.url)
        """``wait_replicas`` (0: off) and ``wait_timeout_ms`` (milliseconds): with replicas
        to wait for, :meth:`submit_many` sends ``WAIT`` after its ``ZADD``, on the same
        connection (docs/topology.md#failover)."""
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

    def _member(self, request: Mapping[str, Any], token: str, now: float) -> tuple[str, int, bytes]:
        """The exact member bytes of ``request``, checked by the consumer's own parser.

        Returns ``(id, deadline, member)``. Raises :class:`SubmitError` (``index`` unset)."""
        doc = self.envelope(request, token)
        data = doc.get("data")
        if isinstance(data, Mapping):  # else parse_member names `$.data` below
            self._check(data, now)
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
        try:
            member = text.encode()
        except UnicodeEncodeError:
            # json.loads accepts an escaped lone surrogate ("\ud800"); UTF-8 cannot carry it.
            raise SubmitError(
                "request holds a string with a lone surrogate escape (such as \\ud800), "
                "which is not valid Unicode"
            ) from None
        parsed = parse_member(member)
        if isinstance(parsed, Invalid):
            raise SubmitError(parsed.reason.removeprefix("Failed: "))
        return parsed.id, parsed.deadline, member

    async def submit_many(self, requests: Iterable[Mapping[str, Any]]) -> list[str]:
        """Submit requests atomically, all or none, in one MULTI/EXEC (docs/protocol.md#producer).

        Each request is an envelope (it has ``data``) or a bare ``data`` object, with
        ``id`` (non-empty string) and ``deadline`` (JSON integer, Unix seconds, in the
        future by the Redis server clock, at most
        :data:`~claimkit.protocol.models.MAX_DEADLINE`). Every request is checked before anything is
        written: its exact member bytes must pass the consumer's parser
        (:func:`~claimkit.protocol.models.parse_member`), so nothing submitted is later
        dead-lettered as malformed. Per request the transaction runs ``DEL
        request-cancel:<id>``, ``SET request-active:<id> <token> PXAT <deadline ms>`` and
        ``ZADD <q> <deadline> <member>``.

        On a Redis Cluster those keys live in different slots and no MULTI may span them
        (docs/topology.md#retries-cancellation-and-the-producer): the writes go in three
        round trips in a safe order, every ``DEL request-cancel:<id>``, then every ``SET
        request-active:<id>``, then one ``ZADD`` of all members (the queue last: a request
        is never pending without its active marker). A call that fails part-way has then
        queued nothing, or (at the ``ZADD``, one command) everything; it may leave active
        markers of requests never queued, which expire at their deadlines.

        Returns:
            The generated ``request_token`` (32 hex characters) of each request, in order.
            An empty input writes nothing and returns ``[]``.

        Raises:
            SubmitError: a request is invalid (its position in ``index``), or the queue key
                holds another Redis type; nothing was written.
            StorePermissionError: the Redis user may not run ``MULTI``/``EXEC`` or one of the
                commands or keys (``written`` is ``False``: nothing was written, so the call
                can be retried once the ACL is fixed without submitting twice).
            StoreUnavailable, StoreError: from the store.
        """
        now_reply, kind = await self.store.pipeline(
            [["TIME"], ["TYPE", self.queue]], transaction=False
        )
        now = _server_now(now_reply)
        kind = reply_text(kind)
        if kind not in (_keys.PENDING_TYPE, "none"):
            # Checked first: MULTI/EXEC does not roll back, so a failing ZADD would leave the
            # request-active marker of a request that was never queued.
            raise SubmitError(f"queue key {self.queue!r} holds a {kind}, not a sorted set")
        written: list[tuple[str, str, int, bytes]] = []
        for index, request in enumerate(requests):
            token = secrets.token_hex(16)
            try:
                rid, deadline, member = self._member(request, token, now)
            except SubmitError as exc:
                raise SubmitError(str(exc), index=index) from None
            written.append((rid, token, deadline, member))
        if not written:
            return []
        if self.cluster or self.wait.replicas:
            await self._submit_in_order(written)
            return [token for _, token, _, _ in written]
        commands: list[list[Arg]] = []
        for rid, token, deadline, member in written:
            commands += [
                ["DEL", _keys.request_cancel(rid)],
                ["SET", _keys.request_active(rid), token, "PXAT", deadline * 1000],
                ["ZADD", self.queue, deadline, member.decode()],
            ]
        await self.store.pipeline(commands, transaction=True)
        return [token for _, token, _, _ in written]

    async def _submit_in_order(self, written: list[tuple[str, str, int, bytes]]) -> None:
        """The cluster submit, and any submit that waits for replicas: cancel markers
        deleted, active markers set, then the queue, each step one pipelined round trip,
        the next sent only once the last answered. Waiting, the ``ZADD`` is followed by
        ``WAIT`` in its pipeline (one connection); fewer replicas in time is warned about,
        as for the consumer's scripts (:meth:`ReplicaWait.check`)."""
        await self.store.pipeline(
            [["DEL", _keys.request_cancel(rid)] for rid, _, _, _ in written], transaction=False
        )
        await self.store.pipeline(
            [
                ["SET", _keys.request_active(rid), token, "PXAT", deadline * 1000]
                for rid, token, deadline, _ in written
            ],
            transaction=False,
        )
        scored: list[Arg] = []
        for _, _, deadline, member in written:
            scored += [deadline, member.decode()]
        if not self.wait.replicas:
            await self.store.command("ZADD", self.queue, *scored)
            return
        _added, confirmed = await self.store.pipeline(
            [["ZADD", self.queue, *scored], list(self.wait.command())], transaction=False
        )
        self.wait.check("submit", confirmed)

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
            ValueError: ``count`` or ``lease_ms`` below 1; on a Redis Cluster, a list name
                whose keys cannot share its slot.
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
            ValueError: ``lease_ms`` below 1. StoreError, StoreUnavailable: from the store.

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
            lease_seconds: the lease, **seconds** (> 0; default 300).
            poll_seconds: seconds between receives while the list is empty (default 1).
            batch: records claimed per receive (default 1).
            on_renew_error: called when a renewal tick cannot reach Redis (then retried).

        Raises:
            ValueError: an argument out of range.

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
